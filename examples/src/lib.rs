//! Helpers shared by the examples in `src/bin/`.
//!
//! Module map: [`mlp`], the small deterministic network the serving example
//! runs; and in this file, [`spawn_or_join`], which gives an example both
//! launch styles of the tutorial: started by a launcher (`m8d launch`,
//! torchrun) it reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`;
//! started bare, it launches its own ranks by running itself once per rank.

pub mod mlp;

use std::ffi::OsString;

use multiworld::WorldConfig;

/// If the launcher variables are set, returns this rank's configuration of
/// `world`. Otherwise runs this program `nproc` times as ranks (through
/// `m8d::launch`) and exits with their combined exit code.
pub async fn spawn_or_join(world: &str, nproc: u32) -> anyhow::Result<WorldConfig> {
    if std::env::var_os("RANK").is_some() {
        return Ok(WorldConfig::from_env(world)?);
    }
    let program = std::env::current_exe()?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let outcome = m8d::launch::launch(m8d::launch::LaunchConfig {
        nproc,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        program: program.into_os_string(),
        args,
        grace: std::time::Duration::from_secs(5),
    })
    .await?;
    std::process::exit(outcome.code);
}

/// The number of ranks asked for with `--nproc N` (default `default`).
pub fn nproc_arg(default: u32) -> u32 {
    arg("--nproc").and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The value after `name` on the command line, if any.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).find(|w| w[0] == name).map(|w| w[1].clone())
}

/// A child process of an example, killed and reaped when dropped.
#[derive(Debug)]
pub struct Process(pub std::process::Child);

impl Process {
    /// SIGKILLs the process and reaps it.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.0.kill()?;
        self.0.wait()?;
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs this example's own program again with `args` (its worker role),
/// output discarded.
pub fn spawn_self(args: &[&str]) -> anyhow::Result<Process> {
    let child = std::process::Command::new(std::env::current_exe()?)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    Ok(Process(child))
}
