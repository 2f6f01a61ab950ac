//! `agentscope nats-auth`: an installation's NATS credentials, generated once.

use anyhow::Context;

pub(crate) fn nats_auth(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    if dir.join("auth.conf").exists() {
        println!("{} already holds NATS credentials; kept", dir.display());
        return Ok(());
    }
    let setup = agentscope_bus::auth::Setup::generate();
    let write = |name: &str, text: &str| -> anyhow::Result<()> {
        let path = dir.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("create {}", path.display()))?;
        f.write_all(text.as_bytes())?;
        Ok(())
    };
    for (user, password) in &setup.passwords {
        write(&format!("{user}.password"), password)?;
    }
    write("callout.seed", &setup.issuer.seed())?;
    // Last: its presence says the directory is complete.
    write("auth.conf", &setup.server_config())?;
    println!("NATS credentials written to {}", dir.display());
    Ok(())
}
