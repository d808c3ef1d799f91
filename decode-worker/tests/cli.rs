//! The decode-worker binary's command line: configuration problems are reported together, unknown keys refused.

use std::process::Command;

#[test]
fn configuration_problems_are_reported_together() {
    let dir = std::env::temp_dir().join(format!("tandem-worker-conf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let conf = dir.join("worker.toml");
    std::fs::write(&conf, "role = \"sideways\"\ncerts_dir = \"/nonexistent/certs\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_decode-worker"))
        .arg("--config")
        .arg(&conf)
        .args(["--model", "/nonexistent/model.gguf"])
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("role \"sideways\"") && err.contains("/nonexistent/certs") && err.contains("tandem certs init"),
        "{err}"
    );
    std::fs::write(&conf, "rol = \"decode\"\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_decode-worker")).arg("--config").arg(&conf).output().expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("rol"), "unknown keys are errors: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}
