//! Where a world secret comes from on the command line: a file (preferred) or
//! the `MULTIWORLD_SECRET` environment variable, never an argument (which any
//! user could read in the process list).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use multiworld_store::Secret;

/// Flags that name a secret.
#[derive(Args, Debug, Clone)]
pub struct SecretArgs {
    /// Read the world secret from this file (trailing newlines ignored, as
    /// `$(cat FILE)` drops them).
    #[arg(long, value_name = "FILE", conflicts_with = "secret_env")]
    pub secret_file: Option<PathBuf>,
    /// Take the world secret from the MULTIWORLD_SECRET environment variable.
    #[arg(long)]
    pub secret_env: bool,
}

impl SecretArgs {
    /// The secret the flags name, if any.
    pub fn load(&self) -> anyhow::Result<Option<Secret>> {
        Ok(self.load_bytes()?.map(Secret::new))
    }

    /// The secret's bytes, if the flags name one.
    pub fn load_bytes(&self) -> anyhow::Result<Option<Vec<u8>>> {
        if let Some(path) = &self.secret_file {
            let mut text =
                std::fs::read(path).with_context(|| format!("reading secret file {}", path.display()))?;
            while matches!(text.last(), Some(b'\n' | b'\r')) {
                text.pop();
            }
            anyhow::ensure!(!text.is_empty(), "secret file {} is empty", path.display());
            return Ok(Some(text));
        }
        if self.secret_env {
            let value = std::env::var_os("MULTIWORLD_SECRET")
                .context("--secret-env given but MULTIWORLD_SECRET is not set")?;
            anyhow::ensure!(!value.is_empty(), "MULTIWORLD_SECRET is empty");
            use std::os::unix::ffi::OsStringExt;
            return Ok(Some(value.into_vec()));
        }
        Ok(None)
    }
}
