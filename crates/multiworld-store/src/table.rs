//! The key-value table of one world's store: an I/O-free state machine.
//!
//! Time is an argument (`now`), never read here, so every operation, timeout
//! and wake-up is tested with a fake clock. Pending waits are registered with
//! an opaque token `W` chosen by the caller (the async service stores a
//! oneshot sender there; tests use integers); operations that satisfy, time
//! out, cancel or close waits hand the tokens back as [`Completion`]s for the
//! caller to deliver. The table never blocks and never calls back.
//!
//! Invariants: every pending waiter is in `waiters`, in `deadlines` once, and
//! in the set `watch[k]` for each of its (distinct) keys, so releasing or
//! removing a waiter costs O(its keys · log n), never a scan of every waiter
//! on a key; `bytes_used` is the sum of key and
//! value lengths; `per_client[c]` counts `c`'s pending waiters (entries at 0
//! are removed). A closed table holds no data and no waiters. Replies are
//! bounded here, before they are built: a wait whose values would exceed
//! [`Limits::max_reply_bytes`] fails with `LimitExceeded` instead.

use std::{
    collections::{BTreeSet, HashMap, hash_map::Entry},
    time::{Duration, Instant},
};

use bytes::{Bytes, BytesMut};

use crate::{
    error::{Limit, StoreError},
    limits::{Limits, over},
};

/// Identifies the client connection a wait belongs to, for per-client bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientId(pub u64);

/// Identifies one pending wait in one table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WaiterId(u64);

/// What a finished wait yields: the values of its keys in request order, or
/// nothing for presence-only waits.
pub type WaitResult = Result<Vec<Bytes>, StoreError>;

/// A pending wait that has finished (satisfied, timed out or closed): its
/// token and the outcome to deliver to it.
#[derive(Debug)]
pub struct Completion<W> {
    /// The token the wait was registered with.
    pub token: W,
    /// The outcome.
    pub result: WaitResult,
}

/// What [`WorldTable::wait`] found.
#[derive(Debug)]
pub enum WaitPoll<W> {
    /// Every key was already present: the result, and the unused token.
    Ready(Vec<Bytes>, W),
    /// The wait is registered; it will come back as a [`Completion`].
    Pending(WaiterId),
}

/// Result of a compare-and-set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CasOutcome {
    /// Whether the value was replaced.
    pub swapped: bool,
    /// The key's value after the operation (`None`: the key does not exist).
    pub current: Option<Bytes>,
}

/// Counters describing a table, for tests and monitoring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TableStats {
    /// Keys stored.
    pub keys: usize,
    /// Bytes of keys plus values stored.
    pub bytes: usize,
    /// Pending waits.
    pub waiters: usize,
}

struct Waiter<W> {
    token: W,
    client: ClientId,
    keys: Vec<Bytes>,
    want_values: bool,
    deadline: Instant,
    timeout: Duration,
}

/// The table of one world's store.
pub struct WorldTable<W> {
    world: String,
    limits: Limits,
    data: HashMap<Bytes, Bytes>,
    bytes_used: usize,
    waiters: HashMap<WaiterId, Waiter<W>>,
    watch: HashMap<Bytes, BTreeSet<WaiterId>>,
    deadlines: BTreeSet<(Instant, WaiterId)>,
    per_client: HashMap<ClientId, usize>,
    next_waiter: u64,
    closed: bool,
}

impl<W> WorldTable<W> {
    /// An empty, open table for `world` with the given bounds.
    pub fn new(world: impl Into<String>, limits: Limits) -> Self {
        WorldTable {
            world: world.into(),
            limits,
            data: HashMap::new(),
            bytes_used: 0,
            waiters: HashMap::new(),
            watch: HashMap::new(),
            deadlines: BTreeSet::new(),
            per_client: HashMap::new(),
            next_waiter: 0,
            closed: false,
        }
    }

    /// The bounds this table enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Whether [`close`](Self::close) was called (the unit tests' view).
    #[cfg(test)]
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Current counters.
    pub fn stats(&self) -> TableStats {
        TableStats {
            keys: self.data.len(),
            bytes: self.bytes_used,
            waiters: self.waiters.len(),
        }
    }

    fn ensure_open(&self) -> Result<(), StoreError> {
        if self.closed {
            Err(StoreError::Closed {
                world: self.world.clone(),
            })
        } else {
            Ok(())
        }
    }

    /// Checks that replacing `key`'s value by one of `new_len` bytes stays in
    /// bounds, before anything is stored.
    fn check_put(&self, key: &[u8], new_len: usize) -> Result<(), StoreError> {
        self.limits.check_key(key)?;
        over(Limit::ValueLen, self.limits.max_value_len, new_len)?;
        let old = self.data.get(key);
        if old.is_none() {
            over(Limit::Keys, self.limits.max_keys, self.data.len() + 1)?;
        }
        let freed = old.map_or(0, |v| key.len() + v.len());
        let total = self.bytes_used - freed + key.len() + new_len;
        over(Limit::TotalBytes, self.limits.max_total_bytes, total)
    }

    /// Stores a value already checked by `check_put` and collects the waits
    /// it completes.
    fn put(&mut self, key: Bytes, value: Bytes, woken: &mut Vec<Completion<W>>) {
        self.store(key.clone(), value);
        self.wake_watchers(&key, woken);
    }

    /// Stores a value without waking anyone (the caller wakes the key's
    /// watchers once everything it stores is in place).
    fn store(&mut self, key: Bytes, value: Bytes) {
        let added = key.len() + value.len();
        if let Some(old) = self.data.insert(key.clone(), value) {
            self.bytes_used -= key.len() + old.len();
        }
        self.bytes_used += added;
    }

    fn wake_watchers(&mut self, key: &[u8], woken: &mut Vec<Completion<W>>) {
        let Some(ids) = self.watch.get(key) else {
            return;
        };
        // One pass over the key's watchers; each removal below touches only
        // the removed waiter's own keys, so releasing n waiters is O(n).
        let ready: Vec<WaiterId> = ids
            .iter()
            .copied()
            .filter(|id| {
                self.waiters
                    .get(id)
                    .is_some_and(|w| w.keys.iter().all(|k| self.data.contains_key(k)))
            })
            .collect();
        for id in ready {
            if let Some(w) = self.remove_waiter(id) {
                let result = if w.want_values {
                    self.reply(&w.keys)
                } else {
                    Ok(Vec::new())
                };
                woken.push(Completion {
                    token: w.token,
                    result,
                });
            }
        }
    }

    /// The values of `keys` (all present) in order, or `LimitExceeded` when
    /// the reply would exceed [`Limits::max_reply_bytes`]. The size is
    /// summed from the stored lengths before any reply is built, so a small
    /// request naming one large key many times costs nothing.
    fn reply(&self, keys: &[Bytes]) -> WaitResult {
        let mut total = 0usize;
        for k in keys {
            let len = self.data.get(k).map_or(0, |v| v.len());
            // A repeated `bytes` field costs a tag, a length prefix and the bytes.
            total = total.saturating_add(len + 1 + varint_len(len));
        }
        over(Limit::ReplyBytes, self.limits.max_reply_bytes, total)?;
        Ok(keys.iter().filter_map(|k| self.data.get(k).cloned()).collect())
    }

    fn remove_waiter(&mut self, id: WaiterId) -> Option<Waiter<W>> {
        let w = self.waiters.remove(&id)?;
        self.deadlines.remove(&(w.deadline, id));
        for k in &w.keys {
            if let Entry::Occupied(mut e) = self.watch.entry(k.clone()) {
                e.get_mut().remove(&id);
                if e.get().is_empty() {
                    e.remove();
                }
            }
        }
        if let Entry::Occupied(mut e) = self.per_client.entry(w.client) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
        Some(w)
    }

    /// Sets `key` to `value`; returns the waits this completes.
    pub fn set(&mut self, key: Bytes, value: Bytes) -> Result<Vec<Completion<W>>, StoreError> {
        self.ensure_open()?;
        self.check_put(&key, value.len())?;
        let mut woken = Vec::new();
        self.put(key, value, &mut woken);
        Ok(woken)
    }

    /// Sets every entry, or none if any is out of bounds.
    pub fn multi_set(&mut self, entries: Vec<(Bytes, Bytes)>) -> Result<Vec<Completion<W>>, StoreError> {
        self.ensure_open()?;
        if entries.is_empty() {
            return Err(StoreError::InvalidArgument("no entries given".into()));
        }
        over(
            Limit::KeysPerRequest,
            self.limits.max_keys_per_request,
            entries.len(),
        )?;
        // Check the whole batch against the bounds as if applied in order,
        // without touching the table (later duplicates replace earlier ones).
        let mut new_keys = 0usize;
        let mut total = self.bytes_used;
        let mut seen: HashMap<&[u8], usize> = HashMap::with_capacity(entries.len());
        for (k, v) in &entries {
            self.limits.check_key(k)?;
            self.limits.check_value(v)?;
            let previous = match seen.insert(k, v.len()) {
                Some(prev_len) => Some(prev_len),
                None => self.data.get(&k[..]).map(|old| old.len()),
            };
            match previous {
                Some(prev_len) => total = total - prev_len + v.len(),
                None => {
                    new_keys += 1;
                    total += k.len() + v.len();
                }
            }
        }
        over(Limit::Keys, self.limits.max_keys, self.data.len() + new_keys)?;
        over(Limit::TotalBytes, self.limits.max_total_bytes, total)?;
        // Store the whole batch first, then wake: a batch is atomic to every
        // reader, so a waiter must never be handed a value that a later entry
        // of the same batch replaced (found by the table fuzzer).
        let mut keys = Vec::with_capacity(entries.len());
        for (k, v) in entries {
            self.store(k.clone(), v);
            keys.push(k);
        }
        let mut woken = Vec::new();
        for k in &keys {
            self.wake_watchers(k, &mut woken);
        }
        Ok(woken)
    }

    /// The value of `key`, if present, without waiting.
    pub fn try_get(&self, key: &[u8]) -> Result<Option<Bytes>, StoreError> {
        self.ensure_open()?;
        self.limits.check_key(key)?;
        Ok(self.data.get(key).cloned())
    }

    /// Adds `delta` to the integer counter at `key` (absent counts as 0; the
    /// value is stored as decimal text, like torch's store) and returns the
    /// new value. A value that is not an integer, or an overflow, is an error.
    pub fn add(&mut self, key: Bytes, delta: i64) -> Result<(i64, Vec<Completion<W>>), StoreError> {
        self.ensure_open()?;
        self.limits.check_key(&key)?;
        let current = match self.data.get(&key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| {
                    StoreError::InvalidArgument(format!(
                        "key '{}' does not hold an integer",
                        String::from_utf8_lossy(&key)
                    ))
                })?,
        };
        let new = current
            .checked_add(delta)
            .ok_or_else(|| StoreError::InvalidArgument(format!("counter overflow: {current} + {delta}")))?;
        let text = Bytes::from(new.to_string());
        self.check_put(&key, text.len())?;
        let mut woken = Vec::new();
        self.put(key, text, &mut woken);
        Ok((new, woken))
    }

    /// Sets `key` to `desired` if its value equals `expected`, where
    /// `expected = None` means "the key must be absent".
    pub fn compare_and_set(
        &mut self,
        key: Bytes,
        expected: Option<&[u8]>,
        desired: Bytes,
    ) -> Result<(CasOutcome, Vec<Completion<W>>), StoreError> {
        self.ensure_open()?;
        self.limits.check_key(&key)?;
        self.limits.check_value(&desired)?;
        let current = self.data.get(&key);
        if current.map(|v| &v[..]) != expected {
            let outcome = CasOutcome {
                swapped: false,
                current: current.cloned(),
            };
            return Ok((outcome, Vec::new()));
        }
        self.check_put(&key, desired.len())?;
        let mut woken = Vec::new();
        self.put(key, desired.clone(), &mut woken);
        let outcome = CasOutcome {
            swapped: true,
            current: Some(desired),
        };
        Ok((outcome, woken))
    }

    /// Appends `value` to `key`'s value (creating it); returns the new length.
    pub fn append(&mut self, key: Bytes, value: &[u8]) -> Result<(usize, Vec<Completion<W>>), StoreError> {
        self.ensure_open()?;
        self.limits.check_key(&key)?;
        let old = self.data.get(&key).map_or(&[][..], |v| &v[..]);
        let new_len = old.len().saturating_add(value.len());
        self.check_put(&key, new_len)?;
        let mut joined = BytesMut::with_capacity(new_len);
        joined.extend_from_slice(old);
        joined.extend_from_slice(value);
        let mut woken = Vec::new();
        self.put(key, joined.freeze(), &mut woken);
        Ok((new_len, woken))
    }

    /// Deletes `key`; reports whether it existed. Waiters on it keep waiting.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError> {
        self.ensure_open()?;
        self.limits.check_key(key)?;
        match self.data.remove_entry(key) {
            Some((k, v)) => {
                self.bytes_used -= k.len() + v.len();
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Whether every key is present.
    pub fn check<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<bool, StoreError> {
        self.ensure_open()?;
        self.limits.check_keys(keys)?;
        Ok(keys.iter().all(|k| self.data.contains_key(k.as_ref())))
    }

    /// Number of keys.
    pub fn num_keys(&self) -> Result<usize, StoreError> {
        self.ensure_open()?;
        Ok(self.data.len())
    }

    /// Waits until every key is present: returns at once if they are, else
    /// registers `token` until they are, `timeout` passes (see
    /// [`expire`](Self::expire)), the wait is cancelled or the table closes.
    /// With `want_values` the values come back in the order of `keys`.
    pub fn wait(
        &mut self,
        client: ClientId,
        keys: Vec<Bytes>,
        want_values: bool,
        now: Instant,
        timeout: Duration,
        token: W,
    ) -> Result<WaitPoll<W>, StoreError> {
        self.ensure_open()?;
        self.limits.check_keys(&keys)?;
        if keys.iter().all(|k| self.data.contains_key(k)) {
            let values = if want_values {
                self.reply(&keys)?
            } else {
                Vec::new()
            };
            return Ok(WaitPoll::Ready(values, token));
        }
        let pending = self.per_client.get(&client).copied().unwrap_or(0);
        over(
            Limit::WaitersPerClient,
            self.limits.max_waiters_per_client,
            pending + 1,
        )?;
        over(
            Limit::WaitersPerWorld,
            self.limits.max_waiters_per_world,
            self.waiters.len() + 1,
        )?;
        let id = WaiterId(self.next_waiter);
        self.next_waiter += 1;
        // A deadline beyond what Instant can represent is as good as never.
        let deadline = now
            .checked_add(timeout)
            .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365));
        for k in &keys {
            self.watch.entry(k.clone()).or_default().insert(id);
        }
        self.deadlines.insert((deadline, id));
        *self.per_client.entry(client).or_insert(0) += 1;
        self.waiters.insert(
            id,
            Waiter {
                token,
                client,
                keys,
                want_values,
                deadline,
                timeout,
            },
        );
        Ok(WaitPoll::Pending(id))
    }

    /// Forgets a pending wait (its caller went away); returns its token if it
    /// was still pending.
    pub fn cancel(&mut self, id: WaiterId) -> Option<W> {
        self.remove_waiter(id).map(|w| w.token)
    }

    /// The earliest deadline of any pending wait (the unit tests' view; the
    /// server expires waits through `expire`).
    #[cfg(test)]
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// Fails every pending wait whose deadline is at or before `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Completion<W>> {
        let mut out = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            if let Some(w) = self.remove_waiter(id) {
                let missing: Vec<String> = w
                    .keys
                    .iter()
                    .filter(|k| !self.data.contains_key(*k))
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .collect();
                out.push(Completion {
                    token: w.token,
                    result: Err(StoreError::Timeout {
                        what: format!("keys {missing:?} of world '{}'", self.world),
                        after: w.timeout,
                    }),
                });
            }
        }
        out
    }

    /// Closes the table: every pending wait fails with `Closed`, all data is
    /// released, and every later call fails with `Closed`.
    pub fn close(&mut self) -> Vec<Completion<W>> {
        self.closed = true;
        let waiters = std::mem::take(&mut self.waiters);
        self.data = HashMap::new();
        self.watch = HashMap::new();
        self.deadlines = BTreeSet::new();
        self.per_client = HashMap::new();
        self.bytes_used = 0;
        waiters
            .into_values()
            .map(|w| Completion {
                token: w.token,
                result: Err(StoreError::Closed {
                    world: self.world.clone(),
                }),
            })
            .collect()
    }
}

/// Bytes of a protobuf varint encoding `n`.
fn varint_len(n: usize) -> usize {
    let bits = usize::BITS - (n | 1).leading_zeros();
    bits.div_ceil(7) as usize
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
