//! `m8d flight FILE` (a broken world's flight record as a timeline) and
//! `m8d status ADDR` (a process's worlds, live, from its metrics endpoint).
//!
//! The status view is pure functions over scraped text ([`parse`],
//! [`summarize`], [`render`]), tested without sockets; the command only
//! fetches `/metrics` twice per refresh and prints.

use std::{
    collections::{BTreeMap, HashMap},
    io::IsTerminal,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};

/// Flags of `m8d flight`.
#[derive(clap::Args, Debug)]
pub struct FlightArgs {
    /// A flight record file (written to MULTIWORLD_FLIGHT_RECORDER_DIR when
    /// a world broke).
    file: PathBuf,
}

/// Prints the record in `args.file` as a timeline.
pub fn flight(args: &FlightArgs) -> anyhow::Result<()> {
    let bytes = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let record: multiworld::FlightRecord = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a flight record", args.file.display()))?;
    print!("{}", record.timeline());
    Ok(())
}

/// Flags of `m8d status`.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The process's metrics endpoint (`host:port`, as served with
    /// `--metrics` or MULTIWORLD_METRICS_ADDR).
    #[arg(value_parser = crate::args::host_port)]
    addr: String,
    /// Seconds between the two scrapes that give the rates.
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "1")]
    interval: Duration,
    /// Keep refreshing until Ctrl-C (on a terminal the screen is redrawn).
    #[arg(long)]
    watch: bool,
}

/// Shows the worlds of the process at `args.addr`.
pub async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let tty = std::io::stdout().is_terminal();
    let mut before = Scrape::fetch(&args.addr).await?;
    loop {
        tokio::time::sleep(args.interval).await;
        let after = Scrape::fetch(&args.addr).await?;
        let view = render(&args.addr, &summarize(&before, &after));
        if args.watch && tty {
            // Clear the screen and go home: a live view.
            print!("\x1b[2J\x1b[H");
        }
        print!("{view}");
        if !args.watch {
            return Ok(());
        }
        before = after;
    }
}

/// One scrape: its samples and when it was taken.
#[derive(Debug, Clone)]
pub struct Scrape {
    at: Instant,
    samples: Vec<Sample>,
}

impl Scrape {
    async fn fetch(addr: &str) -> anyhow::Result<Scrape> {
        let text = get_metrics(addr).await?;
        Ok(Scrape {
            at: Instant::now(),
            samples: parse(&text),
        })
    }
}

/// Largest metrics page `status` reads (a few thousand worlds' series).
const MAX_METRICS_BYTES: usize = 64 << 20;

async fn get_metrics(addr: &str) -> anyhow::Result<String> {
    let stream = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .with_context(|| format!("connecting to {addr}: timed out"))?
        .with_context(|| format!("connecting to {addr}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .context("HTTP handshake")?;
    tokio::spawn(conn);
    let req = hyper::Request::get("/metrics")
        .header(http::header::HOST, addr)
        .body(Empty::<Bytes>::new())?;
    // One bound for the whole answer, its body included (an endpoint that
    // sends its headers and then stalls must not hang `status`), and a
    // limit on its size.
    let answer = async {
        let resp = sender.send_request(req).await?;
        anyhow::ensure!(resp.status().is_success(), "{addr} answered {}", resp.status());
        let body = http_body_util::Limited::new(resp.into_body(), MAX_METRICS_BYTES)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading the answer of {addr}: {e}"))?
            .to_bytes();
        anyhow::Ok(body)
    };
    let body = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .context("the endpoint did not answer within 10 s")??;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// One series' value: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The series name (with its `_total`/`_count` suffix).
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

/// The samples of a scrape in the text format (comments and malformed lines
/// skipped).
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                None => (series.to_string(), BTreeMap::new()),
                Some((name, rest)) => (name.to_string(), parse_labels(rest.strip_suffix('}')?)?),
            };
            Some(Sample { name, labels, value })
        })
        .collect()
}

fn parse_labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => value.push(chars.next()?.1),
                '"' => break i,
                c => value.push(c),
            }
        };
        out.insert(key.trim_start_matches(',').to_string(), value);
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(out)
}

/// One world's line of the status view.
#[derive(Debug, Clone, PartialEq)]
pub struct WorldRow {
    /// The world.
    pub world: String,
    /// Its generation.
    pub generation: String,
    /// This process's rank.
    pub rank: String,
    /// Its state, with the break cause when broken.
    pub state: String,
    /// Peers it has traffic counters for.
    pub peers: usize,
    /// Bytes per second sent and received over the interval.
    pub send_bps: f64,
    /// See `send_bps`.
    pub recv_bps: f64,
    /// Messages per second received over the interval.
    pub recv_mps: f64,
    /// The longest time since a peer was last heard, in seconds.
    pub silent_s: f64,
}

/// What `status` shows: the worlds, and the process's breaks.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    /// One row per world, by name.
    pub worlds: Vec<WorldRow>,
    /// Breaks by cause since the process started.
    pub breaks: BTreeMap<String, f64>,
    /// The last break: world, generation, cause.
    pub last_break: Option<(String, String, String)>,
}

fn key(s: &Sample) -> Option<(String, String, String)> {
    Some((
        s.labels.get("world")?.clone(),
        s.labels.get("generation")?.clone(),
        s.labels.get("rank")?.clone(),
    ))
}

/// The per-world series `summarize` reads.
const PER_WORLD: [&str; 4] = [
    "multiworld_sent_bytes_total",
    "multiworld_received_bytes_total",
    "multiworld_received_messages_total",
    "multiworld_peer_last_heard_seconds",
];

/// One series of one world, over its peers: the sum, how many samples, the
/// largest value (0 with none).
#[derive(Debug, Default, Clone, Copy)]
struct Agg {
    sum: f64,
    count: usize,
    max: f64,
}

/// Index of a scrape's per-world series: series name and world key.
type ByWorld = HashMap<(&'static str, (String, String, String)), Agg>;

/// The [`PER_WORLD`] samples of `scrape`, gathered by series and world in
/// one pass (a page of thousands of worlds is read once, not once per
/// world).
fn by_world(scrape: &Scrape) -> ByWorld {
    let mut out = ByWorld::new();
    for s in &scrape.samples {
        let Some(&name) = PER_WORLD.iter().find(|n| **n == s.name) else {
            continue;
        };
        let Some(k) = key(s) else { continue };
        let a = out.entry((name, k)).or_default();
        a.sum += s.value;
        a.count += 1;
        a.max = a.max.max(s.value);
    }
    out
}

/// The status view from two scrapes (rates over the time between them).
pub fn summarize(before: &Scrape, after: &Scrape) -> View {
    let dt = after
        .at
        .saturating_duration_since(before.at)
        .as_secs_f64()
        .max(1e-3);
    let (was, now) = (by_world(before), by_world(after));
    let get = |index: &ByWorld, name: &'static str, k: &(String, String, String)| {
        index.get(&(name, k.clone())).copied().unwrap_or_default()
    };
    let rate = |name: &'static str, k: &(String, String, String)| {
        ((get(&now, name, k).sum - get(&was, name, k).sum) / dt).max(0.0)
    };
    let mut worlds = Vec::new();
    for s in after
        .samples
        .iter()
        .filter(|s| s.name == "multiworld_world_state")
    {
        let Some(k) = key(s) else { continue };
        let mut state = s.labels.get("state").cloned().unwrap_or_default();
        if let Some(cause) = s.labels.get("cause").filter(|c| !c.is_empty()) {
            state = format!("{state} ({cause})");
        }
        let peers = get(&now, "multiworld_sent_bytes_total", &k).count;
        let silent_s = get(&now, "multiworld_peer_last_heard_seconds", &k).max;
        worlds.push(WorldRow {
            send_bps: rate("multiworld_sent_bytes_total", &k),
            recv_bps: rate("multiworld_received_bytes_total", &k),
            recv_mps: rate("multiworld_received_messages_total", &k),
            world: k.0,
            generation: k.1,
            rank: k.2,
            state,
            peers,
            silent_s,
        });
    }
    worlds.sort_by(|a, b| a.world.cmp(&b.world));
    let breaks = after
        .samples
        .iter()
        .filter(|s| s.name == "multiworld_breaks_total")
        .filter_map(|s| Some((s.labels.get("cause")?.clone(), s.value)))
        .collect();
    let last_break = after
        .samples
        .iter()
        .find(|s| s.name == "multiworld_last_break_timestamp_seconds")
        .and_then(|s| {
            Some((
                s.labels.get("world")?.clone(),
                s.labels.get("generation")?.clone(),
                s.labels.get("cause")?.clone(),
            ))
        });
    View {
        worlds,
        breaks,
        last_break,
    }
}

fn rate_text(bps: f64) -> String {
    match bps {
        b if b >= 1e9 => format!("{:.2} GB/s", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB/s", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB/s", b / 1e3),
        b => format!("{b:.0} B/s"),
    }
}

/// The view as text: a table of worlds, then the breaks.
pub fn render(addr: &str, view: &View) -> String {
    let mut out = format!("worlds of the process at {addr}\n");
    out.push_str(&format!(
        "{:<20} {:>4} {:>5} {:<26} {:>5} {:>12} {:>12} {:>10} {:>9}\n",
        "world", "gen", "rank", "state", "peers", "sent", "received", "msg/s in", "silent"
    ));
    for w in &view.worlds {
        out.push_str(&format!(
            "{:<20} {:>4} {:>5} {:<26} {:>5} {:>12} {:>12} {:>10.0} {:>8.1}s\n",
            w.world,
            w.generation,
            w.rank,
            w.state,
            w.peers,
            rate_text(w.send_bps),
            rate_text(w.recv_bps),
            w.recv_mps,
            w.silent_s
        ));
    }
    if view.worlds.is_empty() {
        out.push_str("(no worlds)\n");
    }
    let breaks: Vec<String> = view
        .breaks
        .iter()
        .filter(|(_, n)| **n > 0.0)
        .map(|(c, n)| format!("{c} {n}"))
        .collect();
    out.push_str(&format!(
        "breaks: {}\n",
        if breaks.is_empty() {
            "none".to_string()
        } else {
            breaks.join(", ")
        }
    ));
    if let Some((world, generation, cause)) = &view.last_break {
        out.push_str(&format!("last break: {world} generation {generation}: {cause}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const T0: &str = r#"# HELP multiworld_world_state x
# TYPE multiworld_world_state gauge
multiworld_world_state{world="w1",generation="3",rank="0",state="ready",cause=""} 1
multiworld_world_state{world="w2",generation="1",rank="0",state="broken",cause="peer_lost"} 1
multiworld_sent_bytes_total{world="w1",generation="3",rank="0",peer="1"} 100
multiworld_received_bytes_total{world="w1",generation="3",rank="0",peer="1"} 1000
multiworld_received_messages_total{world="w1",generation="3",rank="0",peer="1"} 10
multiworld_peer_last_heard_seconds{world="w1",generation="3",rank="0",peer="1"} 0.25
multiworld_breaks_total{cause="peer_lost"} 1
multiworld_last_break_timestamp_seconds{world="w2",generation="1",rank="0",cause="peer_lost"} 1700000000
# EOF
"#;

    #[test]
    fn parses_the_text_format_with_escaped_labels() {
        let s = parse("a_total{x=\"q\\\"uote\",y=\"\"} 3\nb 4.5\n# HELP c\nbroken line\n");
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].labels["x"], "q\"uote");
        assert_eq!(s[0].labels["y"], "");
        assert_eq!((s[1].name.as_str(), s[1].value), ("b", 4.5));
    }

    #[test]
    fn rates_come_from_two_scrapes_and_breaks_are_listed() {
        let t0 = Instant::now();
        let before = Scrape {
            at: t0,
            samples: parse(T0),
        };
        let later = T0
            .replace("peer=\"1\"} 1000", "peer=\"1\"} 3000")
            .replace("peer=\"1\"} 10\n", "peer=\"1\"} 30\n");
        let after = Scrape {
            at: t0 + Duration::from_secs(2),
            samples: parse(&later),
        };
        let view = summarize(&before, &after);
        assert_eq!(view.worlds.len(), 2);
        let w1 = &view.worlds[0];
        assert_eq!(
            (w1.world.as_str(), w1.state.as_str(), w1.peers),
            ("w1", "ready", 1)
        );
        assert_eq!((w1.recv_bps, w1.recv_mps, w1.send_bps), (1000.0, 10.0, 0.0));
        assert_eq!(view.worlds[1].state, "broken (peer_lost)");
        let text = render("127.0.0.1:9464", &view);
        assert!(text.contains("w1") && text.contains("1.0 kB/s"), "{text}");
        assert!(text.contains("breaks: peer_lost 1"), "{text}");
        assert!(text.contains("last break: w2 generation 1: peer_lost"), "{text}");
    }
}

#[cfg(test)]
mod scale {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A page of 2,000 worlds with 8 peers each (64,000 per-peer samples)
    /// is summarized at once, not in time quadratic in its samples.
    #[test]
    fn a_page_of_thousands_of_worlds_is_summarized_at_once() {
        let mut text = String::new();
        for w in 0..2000 {
            let labels = format!("world=\"w{w}\",generation=\"1\",rank=\"0\"");
            text.push_str(&format!(
                "multiworld_world_state{{{labels},state=\"ready\",cause=\"\"}} 1\n"
            ));
            for p in 1..=8 {
                for name in PER_WORLD {
                    text.push_str(&format!("{name}{{{labels},peer=\"{p}\"}} {p}\n"));
                }
            }
        }
        let t0 = Instant::now();
        let scrape = |at| Scrape {
            at,
            samples: parse(&text),
        };
        let view = summarize(&scrape(t0), &scrape(t0 + Duration::from_secs(1)));
        assert_eq!(view.worlds.len(), 2000);
        assert!(view.worlds.iter().all(|w| w.peers == 8 && w.silent_s == 8.0));
        assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    }
}
