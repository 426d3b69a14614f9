//! Helpers of the facade's (`multiworld`) tests (feature `facade`).

use std::time::{Duration, Instant};

use multiworld::WorldEvent;
use tokio::sync::broadcast;

/// The next event of `rx` about `world`, skipping events of other worlds;
/// panics if none comes within `limit` or the channel fails (closed, or the
/// receiver lagged).
pub async fn next_event_for(
    rx: &mut broadcast::Receiver<WorldEvent>,
    world: &str,
    limit: Duration,
) -> WorldEvent {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Ok(e)) if e.world() == world => return e,
            Ok(Ok(_)) => continue,
            Ok(Err(e)) => panic!("event channel: {e}"),
            Err(_) => panic!("no event for {world} within {limit:?}"),
        }
    }
}
