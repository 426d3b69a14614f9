//! Times set, get and ping separately against a store server: a tool for
//! finding where a store round trip's time goes.
//!
//! ```text
//! m8d store --bind 127.0.0.1:0            # prints "listening on ADDR"
//! cargo run --release -p multiworld-store --example store_rtt -- ADDR [ITERATIONS]
//! ```

use std::time::{Duration, Instant};

use multiworld_store::{ClientConfig, OpenOptions, StoreClient};

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().ok_or("usage: store_rtt ADDR [ITERATIONS]")?;
    let n: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(2000).max(1);
    let client = StoreClient::connect(&addr, ClientConfig::default()).await?;
    let w = client
        .open(
            "rtt",
            OpenOptions {
                create: true,
                ..Default::default()
            },
        )
        .await?;
    let value = bytes::Bytes::from_static(&[7u8; 64]);
    let (mut set, mut get, mut ping, mut pair) = (vec![], vec![], vec![], vec![]);
    for i in 0..n {
        let key = format!("k{}", i % 64);
        let t0 = Instant::now();
        w.set(&key, value.clone()).await?;
        let t1 = Instant::now();
        w.get(&key, Duration::from_secs(10)).await?;
        let t2 = Instant::now();
        client.ping().await?;
        let t3 = Instant::now();
        set.push(t1 - t0);
        get.push(t2 - t1);
        pair.push(t2 - t0);
        ping.push(t3 - t2);
    }
    println!(
        "median µs: set {:.1} get {:.1} set+get {:.1} ping {:.1}",
        median(set),
        median(get),
        median(pair),
        median(ping)
    );
    Ok(())
}
