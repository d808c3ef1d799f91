//! Compiles the `.proto` files with protox (pure Rust: no `protoc` needed) and generates tonic/prost code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "tandem/worker/v1/worker.proto";
    println!("cargo:rerun-if-changed=proto/{file}");
    let descriptors = protox::compile([file], ["proto"])?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(descriptors)?;
    Ok(())
}
