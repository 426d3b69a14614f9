//! `m8d kv`: one operation against one world's store, printing the result on
//! stdout. Exit code 0 on success, 1 on any error (printed on stderr).

use std::time::Duration;

use clap::{Args, Subcommand};
use multiworld_store::{ClientConfig, OpenOptions, StoreClient};

use crate::secret::SecretArgs;

/// Flags of `m8d kv`.
#[derive(Args, Debug)]
pub struct KvArgs {
    /// The store server, host:port.
    #[arg(long, value_parser = crate::args::host_port, default_value = "127.0.0.1:29400")]
    pub addr: String,
    /// The world whose store to use.
    #[arg(long)]
    pub world: String,
    /// Create the world's store if the server allows it.
    #[arg(long)]
    pub create: bool,
    /// How long to keep trying to reach the server and the world.
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "10")]
    pub connect_timeout: Duration,
    #[command(flatten)]
    pub secret: SecretArgs,
    #[command(subcommand)]
    pub op: KvOp,
}

/// The operations.
#[derive(Subcommand, Debug)]
pub enum KvOp {
    /// Set KEY to VALUE.
    Set {
        /// The key.
        key: String,
        /// The value.
        value: String,
    },
    /// Wait for KEY and print its value (its bytes as they are, then a newline).
    Get {
        /// The key.
        key: String,
        /// Seconds to wait.
        #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "30")]
        timeout: Duration,
    },
    /// Add DELTA to the counter at KEY and print the new value.
    Add {
        /// The key.
        key: String,
        /// The amount.
        #[arg(allow_negative_numbers = true)]
        delta: i64,
    },
    /// Wait until every KEY exists.
    Wait {
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
        /// Seconds to wait.
        #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "30")]
        timeout: Duration,
    },
    /// Delete KEY.
    Delete {
        /// The key.
        key: String,
    },
    /// Print the number of keys.
    Keys,
    /// Print the round trip to the world's store.
    Ping,
}

/// Runs the operation.
pub async fn run(args: KvArgs) -> anyhow::Result<()> {
    let config = ClientConfig {
        connect_timeout: args.connect_timeout,
        ..ClientConfig::default()
    };
    let client = StoreClient::connect(&args.addr, config).await?;
    let options = OpenOptions {
        secret: args.secret.load()?,
        create: args.create,
        timeout: args.connect_timeout,
    };
    let w = client.open(&args.world, options).await?;
    match args.op {
        KvOp::Set { key, value } => w.set(key, value).await?,
        KvOp::Get { key, timeout } => {
            let v = w.get(key, timeout).await?;
            // The value's own bytes (a binary value is not mangled), then a
            // newline.
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            out.write_all(&v)?;
            out.write_all(b"\n")?;
            out.flush()?;
        }
        KvOp::Add { key, delta } => println!("{}", w.add(key, delta).await?),
        KvOp::Wait { keys, timeout } => w.wait(&keys, timeout).await?,
        KvOp::Delete { key } => println!("{}", w.delete(key).await?),
        KvOp::Keys => println!("{}", w.num_keys().await?),
        KvOp::Ping => println!("{:?}", w.ping().await?),
    }
    Ok(())
}
