//! `tandem certs init`: a development CA and component certificates for mutual TLS.

use std::path::PathBuf;
use std::process::ExitCode;

use kv_transfer::tls::DevCa;

/// Components of a default local cluster.
const DEFAULT_COMPONENTS: &[&str] = &["router", "prefill-0", "prefill-1", "decode-0", "decode-1"];

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Where to write the files (default: $TANDEM_HOME/certs).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Components to issue certificates for.
    #[arg(long, value_delimiter = ',')]
    components: Vec<String>,
    /// Extra DNS names or IP addresses every certificate is valid for (a Kubernetes Service name, say).
    #[arg(long = "name", value_delimiter = ',')]
    names: Vec<String>,
    /// Replace an existing CA (every certificate it signed stops being trusted).
    #[arg(long, conflicts_with = "if_absent")]
    force: bool,
    /// Succeed without writing anything when the directory already holds a CA (a one-shot container that runs
    /// at every start of a cluster).
    #[arg(long)]
    if_absent: bool,
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    let dir = match args.dir {
        Some(d) => d,
        None => engine::fetch::tandem_home().map_err(|e| e.to_string())?.join("certs"),
    };
    if dir.join("ca.pem").exists() && args.if_absent {
        println!("{} already holds a CA; keeping it", dir.display());
        return Ok(ExitCode::SUCCESS);
    }
    if dir.join("ca.pem").exists() && !args.force {
        return Err(format!("{} already holds a CA; pass --force to replace it", dir.display()));
    }
    let components: Vec<String> = if args.components.is_empty() {
        DEFAULT_COMPONENTS.iter().map(|c| (*c).to_string()).collect()
    } else {
        args.components
    };
    let ca = DevCa::generate().map_err(|e| e.to_string())?;
    ca.write(&dir).map_err(|e| e.to_string())?;
    for name in &components {
        let id = ca.issue(name, &args.names).map_err(|e| e.to_string())?;
        id.write(&dir, name).map_err(|e| e.to_string())?;
    }
    println!("wrote a development CA and certificates for {} to {}", components.join(", "), dir.display());
    Ok(ExitCode::SUCCESS)
}
