//! deploy/ checked offline: the Kubernetes overlays render, validate strictly and keep their invariants (probes,
//! UDP for QUIC, selectors, budgets, GPU requests equal to limits, headless worker Services that the router
//! follows), and yamllint and hadolint pass (`scripts/deploy/check.py`; `pip install -r deploy/requirements.txt`).
//! The compose file is checked by running it (`compose.rs`), and parsed here as Compose reads it.

use std::process::Command;

fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the repository").to_path_buf()
}

#[test]
fn kubernetes_manifests_render_validate_and_keep_their_invariants_and_the_files_lint_clean() {
    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python).arg(repo().join("scripts/deploy/check.py")).output().expect("python runs");
    assert!(
        out.status.success(),
        "deploy/ checks failed (needs kubectl and `pip install -r deploy/requirements.txt`):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_compose_file_and_every_profile_parse() {
    let program = tandem_tests::compose::compose_program();
    let out = Command::new(&program[0])
        .args(&program[1..])
        .arg("-f")
        .arg(repo().join("deploy/compose/docker-compose.yml"))
        .args(["--profile", "gpu", "--profile", "observability", "config", "-q"])
        .output()
        .expect("compose runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
