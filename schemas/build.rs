fn main() -> std::io::Result<()> {
    let protoc = protoc_bin_vendored::protoc_bin_path().map_err(std::io::Error::other)?;
    // SAFETY: build scripts are single-threaded; prost-build reads PROTOC from the environment.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto");
    prost_build::compile_protos(&["proto/agentscope/v1/bus.proto"], &["proto"])
}
