//! [`StoreRendezvous`]: the TCP backend's [`Rendezvous`] over a world's store,
//! so ranks publish and find their transport addresses in the world's own
//! store. It remembers whether the store said the world's generation is gone,
//! which tells a joining rank to open the store again (it raced with a
//! teardown of the previous generation) rather than give up.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use multiworld_store::{StoreError, WorldStore};
use multiworld_tcp::{BoxFuture, Rendezvous, RendezvousError};

/// A [`Rendezvous`] backed by one world's store.
#[derive(Debug, Clone)]
pub struct StoreRendezvous {
    store: WorldStore,
    gone: Arc<AtomicBool>,
}

impl StoreRendezvous {
    /// Wraps a world's store.
    pub fn new(store: WorldStore) -> StoreRendezvous {
        StoreRendezvous {
            store,
            gone: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether a call found the world's store closed or replaced by a newer
    /// generation.
    pub fn world_gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }

    fn map(&self, err: StoreError) -> RendezvousError {
        if matches!(
            err,
            StoreError::Closed { .. } | StoreError::StaleGeneration { .. } | StoreError::WorldNotFound { .. }
        ) {
            self.gone.store(true, Ordering::Relaxed);
        }
        match err {
            StoreError::Timeout { what, after } => RendezvousError::Timeout { key: what, after },
            other => RendezvousError::Unavailable(Arc::from(other.to_string())),
        }
    }
}

impl Rendezvous for StoreRendezvous {
    fn set<'a>(&'a self, key: &'a str, value: Vec<u8>) -> BoxFuture<'a, Result<(), RendezvousError>> {
        Box::pin(async move { self.store.set(key, value).await.map_err(|e| self.map(e)) })
    }

    fn get<'a>(&'a self, key: &'a str, timeout: Duration) -> BoxFuture<'a, Result<Vec<u8>, RendezvousError>> {
        Box::pin(async move {
            match self.store.get(key, timeout).await {
                Ok(v) => Ok(v.to_vec()),
                Err(StoreError::Timeout { after, .. }) => Err(RendezvousError::Timeout {
                    key: key.to_string(),
                    after,
                }),
                Err(e) => Err(self.map(e)),
            }
        })
    }
}
