//! Progress bars on stderr for the model fetch.

use engine::fetch::FetchProgress;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Shows each fetch stage as a byte progress bar on stderr (hidden when stderr is not a terminal).
#[derive(Debug)]
pub struct Bar {
    bar: ProgressBar,
}

impl Bar {
    pub fn new() -> Bar {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} ({bytes_per_sec})")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        Bar { bar }
    }
}

impl FetchProgress for Bar {
    fn stage(&self, message: &str) {
        eprintln!("{message}");
        self.bar.reset();
        self.bar.set_message(message.to_string());
    }

    fn bytes(&self, done: u64, total: u64) {
        self.bar.set_length(total);
        self.bar.set_position(done);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
