//! How ranks find each other: the [`Rendezvous`] trait (publish a value under a key,
//! wait for another rank's key) and [`MemoryRendezvous`], an in-process
//! implementation shared by `Arc` between ranks of one process (tests, benchmarks,
//! single-process demos). The world's real store client implements the same trait
//! in another crate, so this crate does not depend on it. The trait returns boxed
//! futures so it is object-safe (`&dyn Rendezvous`); it is only used while joining,
//! never on the data path.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

/// A boxed, `Send` future, as returned by [`Rendezvous`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a rendezvous operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// Nobody published the key in time.
    #[error("key {key:?} was not published within {after:?}")]
    Timeout {
        /// The key waited for.
        key: String,
        /// How long was waited.
        after: Duration,
    },
    /// The store cannot be reached or refused the operation.
    #[error("rendezvous store unavailable: {0}")]
    Unavailable(Arc<str>),
}

/// A key-value rendezvous scoped to one world: ranks publish their listener address
/// with [`Rendezvous::set`] and look up their peers' with [`Rendezvous::get`].
/// Keys used by this crate are built by [`crate::mesh::addr_key`] and include the
/// world name and generation.
pub trait Rendezvous: Send + Sync {
    /// Publishes `value` under `key` (overwriting any previous value).
    fn set<'a>(&'a self, key: &'a str, value: Vec<u8>) -> BoxFuture<'a, Result<(), RendezvousError>>;

    /// Waits until `key` is published, at most `timeout`, and returns its value.
    fn get<'a>(&'a self, key: &'a str, timeout: Duration) -> BoxFuture<'a, Result<Vec<u8>, RendezvousError>>;
}

/// An in-memory [`Rendezvous`]; clones share the same table.
#[derive(Clone)]
pub struct MemoryRendezvous {
    table: Arc<watch::Sender<HashMap<String, Vec<u8>>>>,
}

impl Default for MemoryRendezvous {
    fn default() -> Self {
        MemoryRendezvous {
            table: Arc::new(watch::Sender::new(HashMap::new())),
        }
    }
}

impl std::fmt::Debug for MemoryRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRendezvous")
            .field("keys", &self.table.borrow().len())
            .finish()
    }
}

impl MemoryRendezvous {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Removes a key (e.g. to simulate a rank that never published).
    pub fn remove(&self, key: &str) {
        self.table.send_modify(|t| {
            t.remove(key);
        });
    }
}

impl Rendezvous for MemoryRendezvous {
    fn set<'a>(&'a self, key: &'a str, value: Vec<u8>) -> BoxFuture<'a, Result<(), RendezvousError>> {
        Box::pin(async move {
            self.table.send_modify(|t| {
                t.insert(key.to_owned(), value);
            });
            Ok(())
        })
    }

    fn get<'a>(&'a self, key: &'a str, timeout: Duration) -> BoxFuture<'a, Result<Vec<u8>, RendezvousError>> {
        Box::pin(async move {
            let mut rx = self.table.subscribe();
            let wait = rx.wait_for(|t| t.contains_key(key));
            match tokio::time::timeout(timeout, wait).await {
                Ok(Ok(t)) => t
                    .get(key)
                    .cloned()
                    .ok_or_else(|| RendezvousError::Unavailable(Arc::from("key vanished"))),
                // The sender lives in `self`, so it cannot be dropped while we wait.
                Ok(Err(_)) => Err(RendezvousError::Unavailable(Arc::from("table closed"))),
                Err(_) => Err(RendezvousError::Timeout {
                    key: key.to_owned(),
                    after: timeout,
                }),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[tokio::test]
    async fn set_then_get_and_wait() {
        let r = MemoryRendezvous::new();
        r.set("a", b"1".to_vec()).await.unwrap();
        assert_eq!(r.get("a", Duration::from_millis(10)).await.unwrap(), b"1");
        let r2 = r.clone();
        let waiter = tokio::spawn(async move { r2.get("b", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        r.set("b", b"2".to_vec()).await.unwrap();
        assert_eq!(waiter.await.unwrap().unwrap(), b"2");
        let e = r.get("c", Duration::from_millis(20)).await.unwrap_err();
        assert!(matches!(e, RendezvousError::Timeout { .. }));
        r.remove("a");
        assert!(r.get("a", Duration::from_millis(1)).await.is_err());
        let dynr: &dyn Rendezvous = &r;
        assert_eq!(dynr.get("b", Duration::ZERO).await.unwrap(), b"2");
    }
}
