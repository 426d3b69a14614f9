//! `m8d store`: a standalone store server. Clients create worlds on it with
//! `Open { create: true }` (protected by the server's secret, if given);
//! it prints `listening on ADDR` on stdout once it accepts connections and
//! shuts down cleanly on Ctrl-C or SIGTERM.

use std::{io::Write, net::SocketAddr, time::Duration};

use clap::Args;
use multiworld_store::{ServerConfig, StoreServer};

use crate::secret::SecretArgs;

/// Flags of `m8d store`.
#[derive(Args, Debug)]
pub struct StoreArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:29400")]
    pub bind: SocketAddr,
    /// Refuse to create worlds for clients: every world must then be opened
    /// by a process that hosts it (the store serves nothing otherwise).
    #[arg(long)]
    pub no_remote_create: bool,
    /// Most worlds open at once.
    #[arg(long, default_value_t = 4096)]
    pub max_worlds: usize,
    #[command(flatten)]
    pub secret: SecretArgs,
}

/// Serves until Ctrl-C or SIGTERM.
pub async fn run(args: StoreArgs) -> anyhow::Result<()> {
    m8d::fleet::die_with_parent()?;
    let config = ServerConfig {
        allow_remote_create: !args.no_remote_create,
        remote_create_secret: args.secret.load()?,
        max_worlds: args.max_worlds,
        ..ServerConfig::default()
    };
    if config.allow_remote_create && config.remote_create_secret.is_none() {
        // Not an error: a world of members without secrets is allowed.
        let env_hint = if std::env::var_os("MULTIWORLD_SECRET").is_some() {
            " (MULTIWORLD_SECRET is set, but the store reads it only with --secret-env)"
        } else {
            ""
        };
        eprintln!(
            "m8d store: no secret (--secret-file FILE, or --secret-env to read MULTIWORLD_SECRET){env_hint}: \
             the worlds it creates for clients are open to anyone who can reach this port, and \
             members holding a secret will refuse them"
        );
    }
    let server = StoreServer::bind(args.bind, config).await?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", server.local_addr())?;
        out.flush()?;
    }
    shutdown_signal().await;
    eprintln!("m8d store: shutting down");
    server.shutdown(Duration::from_secs(2)).await;
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    // Without a signal handler there is no clean way to be told to stop, so
    // the server runs until the process is killed.
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}
