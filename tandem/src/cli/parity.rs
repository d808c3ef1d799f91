//! `tandem model parity`: the CPU reference's logits on fixed steps, written here and compared on a device
//! (`engine::parity`; scripts/device/check.sh runs the comparison on the GPU machine).

use std::path::Path;
use std::process::ExitCode;

use engine::backend::{Backend, Device};
use engine::model::Model;

pub fn run(
    model: &Path,
    write: Option<&Path>,
    check: Option<&Path>,
    device: Device,
    max_rel: f32,
) -> Result<ExitCode, String> {
    let file = engine::gguf::GgufFile::open(model).map_err(|e| e.to_string())?;
    let loaded = Model::load(&file).map_err(|e| e.to_string())?;
    match (write, check) {
        (Some(out), None) => {
            let logits = engine::parity::run(&mut *backend(loaded, Device::Cpu)?).map_err(|e| e.to_string())?;
            engine::parity::write(out, &logits).map_err(|e| format!("{}: {e}", out.display()))?;
            println!(
                "{}: {} reference logit vectors from the CPU engine's reference mode",
                out.display(),
                logits.len()
            );
            Ok(ExitCode::SUCCESS)
        }
        (None, Some(reference)) => {
            let want = engine::parity::read(reference).map_err(|e| format!("{}: {e}", reference.display()))?;
            let started = std::time::Instant::now();
            let got = engine::parity::run(&mut *backend(loaded, device)?).map_err(|e| e.to_string())?;
            let compared = engine::parity::compare(&want, &got)?;
            println!("{:<16}{:>12}{:>12}{:>8}{:>10}", "step", "max abs", "max rel", "top-1", "margin");
            let mut ok = true;
            for c in &compared {
                let pass = c.passes(max_rel);
                ok &= pass;
                println!(
                    "{:<16}{:>12.5}{:>12.5}{:>8}{:>10.4}{}",
                    c.name,
                    c.max_abs,
                    c.max_rel,
                    if c.same_top1 { "same" } else { "diff" },
                    c.margin,
                    if pass { "" } else { "  <- out of tolerance" }
                );
            }
            println!(
                "{} on {device}: {} of {} steps within {max_rel} relative, the same top token where the reference's \
                 margin is clear ({:.1} s)",
                if ok { "PASS" } else { "FAIL" },
                compared.iter().filter(|c| c.passes(max_rel)).count(),
                compared.len(),
                started.elapsed().as_secs_f64()
            );
            Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        _ => Err("give exactly one of --write FILE (compute the CPU reference) and --check FILE (compare)".into()),
    }
}

fn backend(model: Model, device: Device) -> Result<Box<dyn Backend>, String> {
    match device {
        Device::Cpu => {
            let team = engine::team::Team::new(0, "tandem-compute").map_err(|e| e.to_string())?;
            Ok(Box::new(engine::backend::cpu::CpuBackend::new(model, team)))
        }
        Device::Cuda(n) => engine::backend::open_cuda(&model, n),
    }
}
