//! The gate: what the server decides about a request from its headers alone,
//! before it reads a byte of the body, and the rate limit on the log lines
//! its refusals produce. Both are pure (the world's state and `now` are
//! arguments) and tested without sockets; [`front`](crate::front) applies
//! them.
//!
//! The rule that closes world-name enumeration: a request that does not
//! prove a secret gets the same answer whether or not the world it names is
//! open, wherever the server can judge the proof. For an open world with a
//! secret, the secret judges it. For a world that is not open, the server's
//! own secret (`ServerConfig::remote_create_secret`, what `m8d store
//! --secret-file` sets) judges it: a wrong or missing proof is refused as
//! `unauthenticated` with a reason that depends on the request only, exactly
//! as for an open world; a right one learns `world-not-found` (and may
//! create the world where that is allowed). A server without a secret of its
//! own cannot judge a proof for a world it does not know, and members must
//! be able to wait for a world whose host has not opened it yet, so there a
//! missing world answers `world-not-found` (see docs/failure-model.md).

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use multiworld_types::Secret;

use crate::{auth::StoreProof, error::StoreError};

/// What the gate knows about the world a request names.
#[derive(Debug, Clone, Copy)]
pub(crate) enum WorldState<'a> {
    /// No world of that name is open.
    Missing,
    /// The world is open, with this secret (or none: a public world).
    Open(Option<&'a Secret>),
}

/// The gate's decision.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// The request proved the secret of the world it names (or the world is
    /// public): it gets the full bounds.
    Admit,
    /// The request is not tied to an authenticated world (`Open` of a world
    /// the server cannot judge, a world-less `Ping`, an unknown method): it
    /// gets the small pre-authentication bounds.
    PreAuth,
    /// Answered from the headers with this error; the body is never read.
    Refuse(StoreError),
}

/// Methods whose requests name a world.
pub(crate) const WORLD_METHODS: [&str; 15] = [
    "Open",
    "Close",
    "Set",
    "Get",
    "TryGet",
    "Add",
    "CompareAndSet",
    "Wait",
    "Check",
    "Delete",
    "MultiGet",
    "MultiSet",
    "Append",
    "NumKeys",
    "Ping",
];

/// Decides about one request. `method` is the gRPC method name (the last
/// path segment), `world` the name from `mw-world`, `proof` the `mw-auth`
/// value, `state` what is open under that name, `server_secret` the
/// server's own secret.
pub(crate) fn judge(
    method: &str,
    world: Option<&str>,
    proof: Option<&str>,
    state: WorldState<'_>,
    server_secret: Option<&Secret>,
) -> Verdict {
    let Some(world) = world else {
        // A world-less Ping names no world; an unknown method is answered
        // `unimplemented` by the service; both get the small bounds.
        if method == "Ping" || !WORLD_METHODS.contains(&method) {
            return Verdict::PreAuth;
        }
        return Verdict::Refuse(StoreError::InvalidArgument(
            "the request does not name its world in the mw-world metadata entry".into(),
        ));
    };
    let refuse = |reason: &str| {
        Verdict::Refuse(StoreError::Unauthenticated {
            world: world.to_string(),
            reason: reason.to_string(),
        })
    };
    match state {
        WorldState::Open(None) => Verdict::Admit,
        WorldState::Open(Some(secret)) => match secret.verify(world, proof) {
            Ok(()) => Verdict::Admit,
            Err(reason) => refuse(reason),
        },
        WorldState::Missing => match server_secret {
            Some(secret) => match secret.verify(world, proof) {
                Err(reason) => refuse(reason),
                Ok(()) if method == "Open" => Verdict::Admit,
                Ok(()) => not_found(world),
            },
            None if method == "Open" => Verdict::PreAuth,
            None => not_found(world),
        },
    }
}

fn not_found(world: &str) -> Verdict {
    Verdict::Refuse(StoreError::WorldNotFound {
        world: world.to_string(),
    })
}

/// Lets one log line through per `interval` and counts the ones it held
/// back, so a flood of refused requests costs one line per interval.
#[derive(Debug)]
pub(crate) struct LogLimiter {
    interval: Duration,
    /// When a line was last let through, and how many were held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimiter {
    /// A limiter letting one line through per `interval`.
    pub(crate) fn new(interval: Duration) -> LogLimiter {
        LogLimiter {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// Whether to log an event at `now`: `Some(n)` with the number of events
    /// held back since the last line, or `None` to stay silent.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        // A poisoned lock only means a panic elsewhere while counting.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (last, held) = &mut *state;
        match *last {
            Some(t) if now.saturating_duration_since(t) < self.interval => {
                *held += 1;
                None
            }
            _ => {
                *last = Some(now);
                Some(std::mem::take(held))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn kind(v: &Verdict) -> String {
        match v {
            Verdict::Admit => "admit".into(),
            Verdict::PreAuth => "pre-auth".into(),
            Verdict::Refuse(e) => format!("{}: {e}", e.kind()),
        }
    }

    #[test]
    fn a_stranger_gets_the_same_answer_for_a_secret_world_and_a_missing_one() {
        let world_secret = Secret::new("world");
        let server_secret = Secret::new("server");
        let wrong = Secret::new("wrong").proof("w");
        for method in ["Open", "Set", "Get", "Ping", "Close"] {
            for proof in [None, Some("garbage"), Some(wrong.as_str())] {
                let open = judge(
                    method,
                    Some("w"),
                    proof,
                    WorldState::Open(Some(&world_secret)),
                    None,
                );
                let missing = judge(
                    method,
                    Some("w"),
                    proof,
                    WorldState::Missing,
                    Some(&server_secret),
                );
                assert!(kind(&open).starts_with("unauthenticated"), "{}", kind(&open));
                assert_eq!(kind(&open), kind(&missing), "{method} {proof:?}");
            }
        }
    }

    #[test]
    fn the_right_secret_is_admitted_or_told_the_world_is_missing() {
        let s = Secret::new("s");
        let proof = s.proof("w");
        let p = Some(proof.as_str());
        assert!(matches!(
            judge("Set", Some("w"), p, WorldState::Open(Some(&s)), None),
            Verdict::Admit
        ));
        assert!(matches!(
            judge("Open", Some("w"), p, WorldState::Missing, Some(&s)),
            Verdict::Admit
        ));
        assert_eq!(
            kind(&judge("Get", Some("w"), p, WorldState::Missing, Some(&s))),
            "world-not-found: no store is open for world 'w'"
        );
        // A proof for another world is no proof for this one.
        let other = s.proof("v");
        assert!(matches!(
            judge("Set", Some("w"), Some(&other), WorldState::Open(Some(&s)), None),
            Verdict::Refuse(StoreError::Unauthenticated { .. })
        ));
    }

    #[test]
    fn public_worlds_world_less_pings_and_unjudgeable_opens() {
        assert!(matches!(
            judge("Set", Some("w"), None, WorldState::Open(None), None),
            Verdict::Admit
        ));
        assert!(matches!(
            judge("Ping", None, None, WorldState::Missing, None),
            Verdict::PreAuth
        ));
        assert!(matches!(
            judge("Bogus", None, None, WorldState::Missing, None),
            Verdict::PreAuth
        ));
        assert!(matches!(
            judge("Open", Some("w"), None, WorldState::Missing, None),
            Verdict::PreAuth
        ));
        assert!(matches!(
            judge("Set", Some("w"), None, WorldState::Missing, None),
            Verdict::Refuse(StoreError::WorldNotFound { .. })
        ));
        assert!(matches!(
            judge("Set", None, None, WorldState::Missing, None),
            Verdict::Refuse(StoreError::InvalidArgument(_))
        ));
    }

    #[test]
    fn the_log_limiter_lets_one_line_per_interval_and_counts_the_rest() {
        let l = LogLimiter::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(l.admit(t0), Some(0));
        for i in 1..1000 {
            assert_eq!(l.admit(t0 + Duration::from_micros(i)), None);
        }
        assert_eq!(l.admit(t0 + Duration::from_secs(1)), Some(999));
        assert_eq!(l.admit(t0 + Duration::from_millis(1500)), None);
        assert_eq!(l.admit(t0 + Duration::from_secs(3)), Some(1));
    }
}
