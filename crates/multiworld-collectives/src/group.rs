//! [`Group`]: a set of a world's ranks that run collectives together (the whole
//! world, or a sub-group made with [`Group::new_group`]), its configuration, and the
//! life of one collective call:
//!
//! 1. **turn**: calls on one group run one at a time, in call order (a fair async
//!    mutex whose queue place a handle-form call takes when it is made, and an
//!    `async fn` call when it is first polled); the call gets the group's next sequence number, which
//!    goes into its tags (see [`super::tags`]);
//! 2. **local validation**: an invalid call (op undefined for the dtype, a root
//!    outside the group, a wrong list length, ...) fails at once with
//!    [`Error::InvalidArgument`], without sending any tensor data; it still sends its
//!    descriptor, marked "abstain", so the other members fail too instead of
//!    waiting for it;
//! 3. **agreement**: one round of descriptors between all members (small direct
//!    payloads ride right behind them), then the same check on every member
//!    (see [`super::desc`]); over TCP, or through the group's shared-memory
//!    segment once it has one (each member writes its descriptor into its
//!    slot and arrives at a barrier: no socket, and one wake-up per member);
//! 4. **algorithm**, while a **guard** watches the world's health: if any member of
//!    the group is lost (or the communicator is aborted) the call fails at once with
//!    that error, even if this rank was only waiting on a live neighbour that is
//!    itself stuck. A deadline (`CollectiveConfig::timeout`, else the communicator's
//!    `op_timeout`) bounds the whole call.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{OwnedMutexGuard, broadcast};
use tracing::debug;

use crate::desc::{self, AgreeCtx, Algo, Desc, Kind};
use crate::handle::CollectiveHandle;
use crate::shm::{self, SharedMemory, ShmChoice, ShmLoan, ShmShared, ShmState};
use crate::util::{Scratch, try_join_all, try_join2};
use multiworld_tcp::{Communicator, HealthEvent, Received, RecvHandle, SendHandle};
use multiworld_tcp::{Error, Result};
use multiworld_types::{DType, Tensor, TensorView};
use multiworld_types::{MAX_GROUP_ID, Phase, check_user_tag, collective_tag};
use multiworld_types::{Rank, Source, Tag};

/// Which algorithm family to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// Direct exchange for small buffers, ring / pipelined chain for large ones
    /// (see [`CollectiveConfig::direct_max_bytes`]); large calls (see
    /// [`CollectiveConfig::shm_min_bytes`]) go through shared memory when every
    /// member is on the same host (see [`Group::shared_memory`]): all-reduce,
    /// broadcast, reduce, all-gather,
    /// reduce-scatter, gather, scatter and the all-to-alls. Once a large call
    /// has set up the group's segment, the all-reduces, broadcasts, reduces,
    /// all-gathers and reduce-scatters of every size go through it.
    #[default]
    Auto,
    /// Always the latency-optimal direct exchange (one round).
    Direct,
    /// Always the bandwidth-optimal ring (reduce-scatter + all-gather) or pipelined
    /// chain (broadcast), where the operation has one; direct otherwise. Never
    /// shared memory.
    Ring,
    /// The operations that [`Algorithm::Auto`] moves through same-host shared
    /// memory use it at every size (where the members cannot share memory: the
    /// ring, or the direct exchange for operations without one); other
    /// operations as with `Ring`.
    SharedMemory,
}

/// Settings of a [`Group`]'s collectives. Fields that change what a call does
/// (`algorithm`, `direct_max_bytes`, `chunk_bytes`, `shm_min_bytes`,
/// `shm_piece_bytes`, `max_object_bytes`) must be the same on every member: a
/// call whose members disagree on them fails on every member.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CollectiveConfig {
    /// Algorithm choice. Default [`Algorithm::Auto`].
    pub algorithm: Algorithm,
    /// With [`Algorithm::Auto`], an operation that has a ring algorithm uses the
    /// direct one while `buffer bytes × (group size − 1)` is at most this (what each
    /// rank would send in a direct all-reduce). Default 256 KiB (see
    /// `COLLECTIVES.md` for the measured crossover).
    pub direct_max_bytes: usize,
    /// A direct algorithm sends its payloads right behind its descriptor, without
    /// waiting for the agreement round, when this rank sends at most this many bytes
    /// in all (the payloads are copied once for that). Default 256 KiB.
    pub eager_max_bytes: usize,
    /// Size of the pipelined pieces of ring and chain algorithms. Default 256 KiB.
    pub chunk_bytes: usize,
    /// Receives posted ahead in a pipeline. Default 4.
    pub pipeline_depth: usize,
    /// Largest serialised object accepted by the object collectives (the
    /// sender checks its object once serialised, every receiver the announced
    /// length before allocating for it; the same on every member). Default
    /// 256 MiB.
    pub max_object_bytes: usize,
    /// Scratch memory a group keeps between calls for reuse. Default 256 MiB.
    pub scratch_cache_bytes: usize,
    /// Deadline of a whole call (`None`: the communicator's `op_timeout`, which also
    /// bounds each internal send and receive). After a timeout the group's state is
    /// unknown: treat the world as broken.
    pub timeout: Option<Duration>,
    /// Whether this member agrees to move data through memory shared with the
    /// other members when they are all on the same host. A member that says no
    /// (or cannot map the segment) makes the whole group use TCP; the members
    /// need not agree on this field. Read when the segment is set up: a
    /// config that says no after that changes nothing (force
    /// `Algorithm::Ring` or `Direct` instead, which every member must).
    /// Default `true`.
    pub shared_memory: bool,
    /// With [`Algorithm::Auto`], an all-reduce, broadcast, reduce,
    /// reduce-scatter or all-gather uses shared memory (when it is available)
    /// once `buffer bytes × (group size − 1)` is at least this, and at every
    /// size once the group's segment is set up; a gather,
    /// scatter or all-to-all once its members move at least this many bytes
    /// between them in all, none of them few enough to send eagerly
    /// ([`CollectiveConfig::eager_max_bytes`]). Must be the same on every
    /// member. Default 256 KiB: from there a call through the segment is
    /// 4–8× faster than over TCP (2 processes, 256 KiB: 0.03–0.09 against
    /// 0.21–0.41 ms), so the segment's setup in the first such call (about
    /// as long as a first call over TCP with 2 processes, 1–5 ms more with
    /// 4 on 2 cores) is repaid within a few calls; groups that only make
    /// small calls never set one up (see `COLLECTIVES.md` §7a).
    pub shm_min_bytes: usize,
    /// Bytes of a tensor that one step of a shared-memory call moves per member
    /// (rounded down to a multiple of 64; an all-to-all moves a part of
    /// `1 / group size` of it between each pair). The group's segment holds a 4 KiB
    /// header, the descriptor slots and three buffers of one slot of this size
    /// per member (12 MiB and 8 KiB for 4 members at the default); larger
    /// tensors go through it in pieces of this size, three in flight at once.
    /// Read when the segment is set up (the group's first call that would use
    /// it): the group's calls keep the segment's pieces from then on, whatever
    /// a later config asks for. Memory is only committed
    /// where it is written, and stays with the group until every member has
    /// dropped it. Must be the same on every member; less than 64 bytes, or a
    /// segment too large to address, turns shared memory off for the group.
    /// Default 1 MiB: small enough for the pieces in flight to stay in the
    /// caches while the members pass them around, large enough that the one
    /// barrier per step costs little (see `docs/benchmarks.md`).
    pub shm_piece_bytes: usize,
    /// How long a member that reaches a barrier of a shared-memory call before
    /// the others keeps checking for them, yielding its thread between checks,
    /// before it sleeps (on a blocking-pool thread, or on the caller's thread in
    /// a blocking call) until the last one wakes it. The others are usually a
    /// piece's copy away (25–30 µs for 1 MiB here), and a sleep costs two or
    /// three thread wake-ups more than that. `Duration::ZERO` sleeps after a
    /// short spin. Need not agree between members. Default 200 µs, or
    /// `MULTIWORLD_SHM_SPIN_US` from the environment: a 1 MiB
    /// scatter, gather or all-to-all of 4 processes on 2 cores 0.44–0.51 →
    /// 0.21–0.32 ms per call (see `docs/benchmarks.md`).
    pub shm_spin: Duration,
}

impl Default for CollectiveConfig {
    fn default() -> Self {
        CollectiveConfig {
            algorithm: Algorithm::Auto,
            direct_max_bytes: 256 << 10,
            eager_max_bytes: 256 << 10,
            chunk_bytes: 256 << 10,
            pipeline_depth: 4,
            max_object_bytes: 256 << 20,
            scratch_cache_bytes: 256 << 20,
            timeout: None,
            shared_memory: true,
            shm_min_bytes: 256 << 10,
            shm_piece_bytes: 1 << 20,
            shm_spin: default_shm_spin(),
        }
    }
}

/// [`CollectiveConfig::shm_spin`]'s default: `MULTIWORLD_SHM_SPIN_US`
/// (microseconds, read once) if set to a whole number, else 200 µs. The
/// variable lets an operator change it for every group of a process without
/// touching the program (on a machine whose cores are oversubscribed, say).
fn default_shm_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        std::env::var("MULTIWORLD_SHM_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(Duration::from_micros(200), Duration::from_micros)
    })
}

impl CollectiveConfig {
    /// Sets the algorithm choice.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Sets whether this member agrees to share memory with the others
    /// (see [`CollectiveConfig::shared_memory`]).
    pub fn with_shared_memory(mut self, on: bool) -> Self {
        self.shared_memory = on;
        self
    }

    /// Sets how long a member waiting at a shared-memory barrier checks
    /// between yields before it sleeps (see [`CollectiveConfig::shm_spin`]).
    pub fn with_shm_spin(mut self, spin: Duration) -> Self {
        self.shm_spin = spin;
        self
    }

    /// Sets the whole-call deadline.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// Identifies the settings that must agree between members.
    fn fingerprint(&self) -> u64 {
        let alg = match self.algorithm {
            Algorithm::Auto => 1u64,
            Algorithm::Direct => 2,
            Algorithm::Ring => 3,
            Algorithm::SharedMemory => 4,
        };
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for v in [
            alg,
            self.direct_max_bytes as u64,
            self.chunk_bytes.max(1) as u64,
            self.shm_min_bytes as u64,
            self.shm_piece_bytes as u64,
            // Each member checks object sizes against its own limit: with
            // different limits one member could refuse an object the others
            // take, and they would wait for what it never sends.
            self.max_object_bytes as u64,
        ] {
            h ^= v;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }
}

/// Per-group state touched only by the call whose turn it is.
pub(crate) struct GroupState {
    seq: u64,
    scratch: Scratch,
    shm: ShmState,
}

/// The sub-group ids of one communicator, as this member knows them.
struct Tree {
    ids: Mutex<GroupIds>,
}

/// How many times [`Group::new_group`] tries to agree on an id that no
/// member has given to another group before it gives up.
const ID_ATTEMPTS: usize = 16;

/// A proposal after a refused round skips a random number of ids below this:
/// two calls that refused each other (each claimed first at a different
/// member) then agree on different ids, rather than crossing again in step.
const RETRY_SPREAD: u16 = 8;

/// Which sub-group ids this member has given out (or holds while the members
/// confirm them), and where its next proposal starts. A pure core: the
/// agreement in [`Group::new_group`] drives it.
#[derive(Debug, Clone)]
pub(crate) struct GroupIds {
    next: u16,
    taken: [u64; 16],
}

impl Default for GroupIds {
    fn default() -> GroupIds {
        let mut ids = GroupIds {
            next: 1,
            taken: [0; 16],
        };
        ids.set(0, true); // the world group
        ids
    }
}

impl GroupIds {
    fn is_taken(&self, id: u16) -> bool {
        let i = usize::from(id);
        self.taken.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    fn set(&mut self, id: u16, on: bool) {
        let i = usize::from(id);
        if let Some(w) = self.taken.get_mut(i / 64) {
            if on {
                *w |= 1 << (i % 64);
            } else {
                *w &= !(1 << (i % 64));
            }
        }
    }

    /// This member's proposal: the first id from its counter on that it has
    /// not given out (past [`MAX_GROUP_ID`] when none is left, which the
    /// agreement refuses).
    pub(crate) fn propose(&mut self) -> u16 {
        self.propose_from(0)
    }

    /// [`GroupIds::propose`], skipping `skip` ids first.
    pub(crate) fn propose_from(&mut self, skip: u16) -> u16 {
        let mut p = self.next.saturating_add(skip);
        while p <= MAX_GROUP_ID && self.is_taken(p) {
            p += 1;
        }
        self.next = p.saturating_add(1);
        p
    }

    /// Takes `id`, agreed by the members, for a new group: false if this
    /// member has given it to another group (or holds it for one being
    /// created). Proposals go on past it either way.
    pub(crate) fn claim(&mut self, id: u16) -> bool {
        self.next = self.next.max(id.saturating_add(1));
        if id > MAX_GROUP_ID || self.is_taken(id) {
            return false;
        }
        self.set(id, true);
        true
    }

    /// Gives back an id claimed for a group that another member refused.
    pub(crate) fn release(&mut self, id: u16) {
        self.set(id, false);
    }
}

impl Tree {
    fn ids(&self) -> std::sync::MutexGuard<'_, GroupIds> {
        self.ids.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Every member's `word`, by member index: one small message to and from each
/// other member on the call's data tag.
async fn all_gather_word(cx: &Ctx<'_>, word: u64) -> Result<Vec<u64>> {
    let mine = [word];
    let sends = try_join_all(cx.peers().map(|q| cx.send(q, &mine[..])));
    let recvs = try_join_all(cx.peers().map(|q| async move {
        let t = cx.recv_new(q, Tensor::from(vec![0u64])).await?;
        Ok((q, t.as_slice::<u64>()?.first().copied().unwrap_or(0)))
    }));
    let (_, got) = try_join2(sends, recvs).await?;
    let mut words = vec![word; cx.n()];
    for (q, w) in got {
        words[q] = w;
    }
    Ok(words)
}

struct GroupInner {
    comm: Arc<Communicator>,
    tree: Arc<Tree>,
    /// Sub-groups keep the world group (and with it the world's call sequence)
    /// alive.
    _parent: Option<Arc<GroupInner>>,
    id: u16,
    members: Vec<Rank>,
    me: Option<usize>,
    hash: u64,
    state: Arc<tokio::sync::Mutex<GroupState>>,
    /// The segment once set up, and whether the current call uses it.
    shm: Arc<ShmShared>,
}

impl GroupInner {
    fn new(
        comm: Arc<Communicator>,
        tree: Arc<Tree>,
        parent: Option<Arc<GroupInner>>,
        id: u16,
        members: Vec<Rank>,
    ) -> GroupInner {
        let me = members.iter().position(|&r| r == comm.rank());
        GroupInner {
            hash: desc::hash_ranks(&members),
            comm,
            tree,
            _parent: parent,
            id,
            members,
            me,
            state: Arc::new(tokio::sync::Mutex::new(GroupState {
                seq: 0,
                scratch: Scratch::new(0),
                shm: ShmState::Untried,
            })),
            shm: Arc::default(),
        }
    }

    /// The error a call must fail with because a member is gone or the
    /// communicator is aborted, if any.
    fn member_failure(&self) -> Option<Error> {
        let h = self.comm.health();
        if let Some(reason) = h.aborted {
            return Some(Error::Aborted { reason });
        }
        h.lost
            .into_iter()
            .find(|(r, _)| self.members.contains(r))
            .map(|(rank, cause)| Error::PeerLost { rank, cause })
    }
}

/// One collective state per communicator: `Group::world` called twice on the same
/// communicator must share the world's call sequence, or the two groups' tags would
/// collide. Touched only when a world group is made, never on the data path.
type Registry = Vec<(Weak<Communicator>, Weak<GroupInner>)>;
static WORLDS: Mutex<Registry> = Mutex::new(Vec::new());

/// A set of ranks of one world that run collectives together: [`Group::world`]
/// (every rank) or a sub-group from [`Group::new_group`] (like torch's
/// `new_group`). Cheap to clone; clones share the group's state.
///
/// Every member must make the same calls on a group in the same order (as with
/// torch.distributed). Roots are world ranks; lists (outputs of `all_gather`,
/// inputs of `scatter`, ...) are indexed by position in [`Group::ranks`] (sorted
/// world ranks). Each operation has a blocking-style `async fn` and a `*_handle`
/// form that starts the call at once (taking its place in the group's order) and
/// returns a [`CollectiveHandle`].
///
/// **Errors.** Every member of a call gets an error, and no member waits forever,
/// when: the call is invalid on some member ([`Error::InvalidArgument`] there, a
/// "rejected its own call" [`Error::InvalidArgument`] on the others); members
/// disagree on the operation, root, reduce op or algorithm settings
/// ([`Error::InvalidArgument`] naming each rank's value), on the dtype, or on
/// the element count where it must be equal everywhere ([`Error::Mismatch`]
/// naming a rank that differs; a disagreement on per-member sizes or splits is
/// [`Error::InvalidArgument`]); a member is
/// lost ([`Error::PeerLost`]) or the communicator aborted ([`Error::Aborted`]). A
/// failed call never reports success: **after an error, the contents of the
/// caller's output tensors are unspecified** (they keep their dtype and shape, and
/// may hold a mix of old data and partial results); inputs are never modified.
/// After an invalid-argument or disagreement error the group stays usable; after
/// `PeerLost`, `Aborted` or `Timeout` the world should be torn down.
#[derive(Clone)]
pub struct Group {
    inner: Arc<GroupInner>,
    cfg: Arc<CollectiveConfig>,
    observer: Option<Arc<dyn CallObserver>>,
}

/// Told when each collective call of a group starts running and how it ends.
/// A runtime that watches its worlds uses it to register every call's
/// deadline with its watchdog and to record and time its calls (see
/// [`Group::with_observer`]). Called on the async task making the call: it
/// must not block.
pub trait CallObserver: Send + Sync {
    /// Call `op` (e.g. `"all_reduce"`) starts; the returned value lives as
    /// long as the call runs.
    fn call_started(&self, op: &'static str) -> Box<dyn CallEnd>;
}

/// The end of one observed call (from [`CallObserver::call_started`]).
pub trait CallEnd: Send {
    /// The call ended with `error` (`None`: it succeeded). A call whose
    /// future is dropped before it ends is not told: its value is dropped.
    fn ended(self: Box<Self>, error: Option<&Error>);
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("id", &self.inner.id)
            .field("members", &self.inner.members)
            .field("rank", &self.inner.comm.rank())
            .finish_non_exhaustive()
    }
}

impl Group {
    /// The group of every rank of `comm`'s world (id 0). Calling it again for the
    /// same communicator returns a group sharing the same state, so that the two
    /// cannot get out of step. The state lives as long as any group of this
    /// communicator does.
    pub fn world(comm: &Arc<Communicator>) -> Group {
        let mut reg = WORLDS.lock().unwrap_or_else(PoisonError::into_inner);
        reg.retain(|(c, g)| c.strong_count() > 0 && g.strong_count() > 0);
        let found = reg
            .iter()
            .find(|(c, _)| std::ptr::eq(c.as_ptr(), Arc::as_ptr(comm)))
            .and_then(|(_, g)| g.upgrade());
        let inner = match found {
            Some(inner) => inner,
            None => {
                let members = (0..comm.size()).map(Rank).collect();
                let tree = Arc::new(Tree {
                    ids: Mutex::new(GroupIds::default()),
                });
                let inner = Arc::new(GroupInner::new(Arc::clone(comm), tree, None, 0, members));
                reg.push((Arc::downgrade(comm), Arc::downgrade(&inner)));
                inner
            }
        };
        Group {
            inner,
            cfg: Arc::new(CollectiveConfig::default()),
            observer: None,
        }
    }

    /// This group with other settings (the state is shared).
    pub fn with_config(&self, cfg: CollectiveConfig) -> Group {
        Group {
            inner: Arc::clone(&self.inner),
            cfg: Arc::new(cfg),
            observer: self.observer.clone(),
        }
    }

    /// This group with an observer told of every call it runs, and of every
    /// call of the sub-groups made from it (the state is shared).
    pub fn with_observer(&self, observer: Arc<dyn CallObserver>) -> Group {
        Group {
            inner: Arc::clone(&self.inner),
            cfg: Arc::clone(&self.cfg),
            observer: Some(observer),
        }
    }

    /// The settings.
    pub fn config(&self) -> &CollectiveConfig {
        &self.cfg
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<Communicator> {
        &self.inner.comm
    }

    /// The group id (0 for the world; folded into the tags).
    pub fn id(&self) -> u16 {
        self.inner.id
    }

    /// The members' world ranks, ascending. Lists in collective calls are indexed
    /// by position in this slice.
    pub fn ranks(&self) -> &[Rank] {
        &self.inner.members
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.inner.members.len()
    }

    /// This rank's position in [`Group::ranks`], or `None` if it is not a member.
    pub fn group_rank(&self) -> Option<usize> {
        self.inner.me
    }

    /// Whether this rank is a member.
    pub fn is_member(&self) -> bool {
        self.inner.me.is_some()
    }

    /// The position of world rank `rank` in [`Group::ranks`].
    pub fn index_of(&self, rank: Rank) -> Option<usize> {
        self.inner.members.iter().position(|&r| r == rank)
    }

    /// Creates a sub-group of `ranks` (world ranks, all members of this group; any
    /// order, no duplicates). Like torch's `new_group`, **every member of this
    /// group must call it, in the same order as its other calls on this group**,
    /// including ranks that will not be members: it is a collective call on this
    /// group that agrees on the new group's id and checks that all callers passed
    /// the same list. Ranks outside `ranks` get a group on which every call fails
    /// with [`Error::InvalidArgument`]. At most 1022 sub-groups per communicator
    /// (ids 1 to 1022, never reused). Sub-groups may be created at the same
    /// time from different parent groups: the members confirm that the
    /// agreed id is free at each of them and agree again if not.
    pub async fn new_group(&self, ranks: &[Rank]) -> Result<Group> {
        let call = self.begin(self.ticket(), Kind::NewGroup).await?;
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let invalid = if sorted.is_empty() {
            Some("a group needs at least one rank".to_owned())
        } else if sorted.len() != ranks.len() {
            Some(format!("ranks {ranks:?} contain duplicates"))
        } else {
            sorted
                .iter()
                .find(|r| !self.inner.members.contains(r))
                .map(|r| format!("rank {r} is not a member of group {}", self.inner.id))
        };
        if let Some(msg) = invalid {
            return Err(call.abstain(Error::invalid(format!("new_group: {msg}"))).await);
        }
        let proposal = self.inner.tree.ids().propose();
        let mut d = call.desc();
        d.count = u64::from(proposal);
        d.aux = desc::hash_ranks(&sorted);
        call.plan(&mut d, 0, 0);
        let cx = call.ctx();
        let tree = &self.inner.tree;
        // The members agree on the largest proposal, then each claims it and
        // they confirm: a member that gave that id to another group meanwhile
        // (one created at the same time from another parent) refuses, and
        // they agree again, on ids past it.
        let agreed = call
            .guard(async {
                let (descs, sends) = cx.exchange(&d, &[]).await?;
                finish_sends(sends).await?;
                let mut id = descs.iter().map(|d| d.count).max().unwrap_or(0);
                for attempt in 1..=ID_ATTEMPTS {
                    let Some(candidate) = u16::try_from(id).ok().filter(|&id| id <= MAX_GROUP_ID) else {
                        // Every member sees the same proposals, so all stop here.
                        return Ok(Err(Error::invalid(format!(
                            "new_group: no sub-group id left (at most {MAX_GROUP_ID})"
                        ))));
                    };
                    let mine = tree.ids().claim(candidate);
                    let confirmed = all_gather_word(&cx, u64::from(mine)).await?;
                    if confirmed.iter().all(|&ok| ok == 1) {
                        return Ok(Ok(candidate));
                    }
                    if mine {
                        tree.ids().release(candidate);
                    }
                    if attempt == ID_ATTEMPTS {
                        break;
                    }
                    let skip = rand::random_range(0..RETRY_SPREAD);
                    let proposal = tree.ids().propose_from(skip);
                    let proposals = all_gather_word(&cx, u64::from(proposal)).await?;
                    id = proposals.into_iter().max().unwrap_or(0);
                }
                Ok(Err(Error::invalid(format!(
                    "new_group: no sub-group id free at every member after {ID_ATTEMPTS} tries \
                     (other sub-groups are being created at the same time); create them one at a time"
                ))))
            })
            .await?;
        let id = agreed?;
        let root = match &self.inner._parent {
            Some(p) => Arc::clone(p),
            None => Arc::clone(&self.inner),
        };
        let inner = GroupInner::new(
            Arc::clone(&self.inner.comm),
            Arc::clone(&self.inner.tree),
            Some(root),
            id,
            sorted,
        );
        Ok(Group {
            inner: Arc::new(inner),
            cfg: Arc::clone(&self.cfg),
            observer: self.observer.clone(),
        })
    }

    /// Frees the scratch memory kept between calls (waits for the group's turn).
    pub async fn release_scratch(&self) {
        let mut st = self.ticket().acquire().await;
        st.scratch.clear();
    }

    /// Scratch bytes kept between calls.
    pub async fn scratch_bytes(&self) -> usize {
        self.ticket().acquire().await.scratch.held()
    }

    /// Whether this group moves large all-reduces through same-host shared
    /// memory (waits for the group's turn). The group finds out in its first
    /// call that would use it; from then on every member reports the same state.
    pub async fn shared_memory(&self) -> SharedMemory {
        self.ticket().acquire().await.shm.status()
    }

    // ---- point-to-point within the group, refusing internal tags ----

    /// [`Communicator::send`] to a member, refusing tags reserved for collectives
    /// (top bit set).
    pub async fn send<'a>(&self, dst: Rank, tag: Tag, data: impl Into<TensorView<'a>>) -> Result<()> {
        self.check_p2p(dst, tag)?;
        self.inner.comm.send(dst, tag, data).await
    }

    /// [`Communicator::recv`] from a member, refusing internal tags.
    pub async fn recv(&self, src: Rank, tag: Tag, buf: &mut Tensor) -> Result<()> {
        self.check_p2p(src, tag)?;
        self.inner.comm.recv(src, tag, buf).await
    }

    /// [`Communicator::isend`] to a member, refusing internal tags.
    pub fn isend(&self, dst: Rank, tag: Tag, data: Tensor) -> Result<SendHandle> {
        self.check_p2p(dst, tag)?;
        Ok(self.inner.comm.isend(dst, tag, data))
    }

    /// [`Communicator::irecv`] from a member, refusing internal tags.
    pub fn irecv(&self, src: Rank, tag: Tag, buf: Tensor) -> Result<RecvHandle> {
        self.check_p2p(src, tag)?;
        Ok(self.inner.comm.irecv(Source::Rank(src), tag, buf))
    }

    fn check_p2p(&self, peer: Rank, tag: Tag) -> Result<()> {
        check_user_tag(tag)?;
        self.member_index()?;
        if self.index_of(peer).is_none() {
            return Err(Error::invalid(format!(
                "rank {peer} is not a member of group {} ({:?})",
                self.inner.id, self.inner.members
            )));
        }
        Ok(())
    }

    // ---- the call life cycle (used by the operation modules) ----

    pub(crate) fn member_index(&self) -> Result<usize> {
        self.inner.me.ok_or_else(|| {
            Error::invalid(format!(
                "rank {} is not a member of group {} (members {:?})",
                self.inner.comm.rank(),
                self.inner.id,
                self.inner.members
            ))
        })
    }

    /// Takes this call's place in the group's order now.
    pub(crate) fn ticket(&self) -> Ticket {
        let mut fut: LockFuture = Box::pin(Arc::clone(&self.inner.state).lock_owned());
        match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(g) => Ticket::Ready(g),
            Poll::Pending => Ticket::Waiting(fut),
        }
    }

    /// Checks membership, waits for the turn, assigns the sequence number.
    ///
    /// A group whose segment is set up agrees through it, unless a member
    /// abandoned it before this call: this member, if its last call was
    /// dropped while it used the segment (it abandons it now), or another one
    /// (it said so in the segment). From that call on the group uses TCP.
    pub(crate) async fn begin(&self, ticket: Ticket, kind: Kind) -> Result<Call<'_>> {
        let me = self.member_index()?;
        let mut guard = ticket.acquire().await;
        let seq = guard.seq;
        guard.seq = guard.seq.wrapping_add(1);
        let shared = &self.inner.shm;
        if shared.in_use.swap(false, Ordering::Relaxed) {
            // The last call was dropped while it used the segment: its
            // arrivals are out of step with the others'.
            if let Some(seg) = shared.segment.get() {
                seg.abandon(self.size(), me, seq);
            }
            guard.shm =
                ShmState::Unavailable("a call using shared memory was cancelled on this member".to_owned());
        } else if let ShmState::Ready(seg) = &guard.shm {
            if let Some(a) = seg.abandonment(self.size()).filter(|a| seq >= a.from) {
                guard.shm = ShmState::Unavailable(format!(
                    "{} abandoned the segment (a call of its that used it was cancelled)",
                    shm::member_name(&self.inner.members, a.by)
                ));
            }
        }
        let agree_in_shm = matches!(guard.shm, ShmState::Ready(_));
        guard.scratch.set_budget(self.cfg.scratch_cache_bytes);
        Ok(Call {
            group: self,
            guard,
            kind,
            seq,
            me,
            agree_in_shm,
        })
    }

    /// The name of the algorithm (`"direct"`, `"ring"` or `"shm"`) a call of
    /// `kind` on `size_bytes` per member uses, given what this member knows now
    /// about shared memory (until the group's first call that could use it, a
    /// large all-reduce is reported as `"shm"`; once shared memory turned out
    /// unavailable, as `"ring"`).
    ///
    /// For gather, scatter and the all-to-alls, whose sizes may differ between
    /// members, the answer assumes every member sends `size_bytes` to each
    /// other one (scatter: the root to each; gather: each to the root), in a
    /// dtype other than `bool` (which never goes through shared memory).
    pub async fn algorithm_name(&self, kind: Kind, size_bytes: u64) -> &'static str {
        let shm = match self.shared_memory().await {
            SharedMemory::Unavailable { .. } => ShmChoice::No,
            SharedMemory::Active { .. } => ShmChoice::Ready,
            _ => ShmChoice::Possible,
        };
        let algo = self.algorithm_with(kind, size_bytes, shm);
        if algo != Algo::Shm || !kind.sized_after_agreement() {
            return algo.name();
        }
        let n = self.size();
        let root = matches!(kind, Kind::Gather | Kind::Scatter).then_some(0);
        let bytes = |p: usize, q: usize| match (kind, root) {
            (Kind::Scatter, Some(r)) if p != r => 0,
            (Kind::Gather, Some(r)) if q != r => 0,
            _ => size_bytes,
        };
        // A member that sends a little sends it eagerly, and then the call
        // uses TCP.
        let sent = |p: usize| (0..n).filter(|&q| q != p).map(|q| bytes(p, q)).sum::<u64>();
        let eager_max = self.cfg.eager_max_bytes as u64;
        if self.cfg.algorithm == Algorithm::Auto && (0..n).any(|p| (1..=eager_max).contains(&sent(p))) {
            return Algo::Direct.name();
        }
        let routes = super::shm::routes_of(kind);
        let piece = super::shm::piece_bytes(&self.inner.shm, &self.cfg, n);
        match routes.and_then(|r| super::shm::plan_moves(r, n, &self.cfg, piece, bytes)) {
            Some(_) => Algo::Shm.name(),
            None => Algo::Direct.name(),
        }
    }

    /// The algorithm a call of `kind` on a buffer of `size_bytes` (per rank)
    /// uses; `shm`: whether the group may still use shared memory, and
    /// whether its segment is set up (the same on every member, see
    /// [`super::shm`]).
    fn algorithm_with(&self, kind: Kind, size_bytes: u64, shm: ShmChoice) -> Algo {
        let ready = shm == ShmChoice::Ready;
        let shm = shm != ShmChoice::No;
        let n = self.size() as u64;
        let ring_capable = matches!(
            kind,
            Kind::Broadcast
                | Kind::Reduce
                | Kind::AllReduce
                | Kind::AllGather
                | Kind::AllGatherInto
                | Kind::ReduceScatter
                | Kind::ReduceScatterTensor
        );
        let piece = super::shm::piece_bytes(&self.inner.shm, &self.cfg, self.size());
        let shm_ok = shm && super::shm::segment_len(piece, self.size()).is_some();
        if kind.sized_after_agreement() {
            // Whether such a call moves its data through the segment is decided
            // after the agreement, from every member's sizes (`shm::plan_moves`);
            // `Shm` here says that the group may.
            return match self.cfg.algorithm {
                Algorithm::Auto | Algorithm::SharedMemory if shm_ok && n > 1 => Algo::Shm,
                _ => Algo::Direct,
            };
        }
        if !ring_capable || n <= 1 {
            return Algo::Direct;
        }
        // A reduce-scatter's contributions travel in a part of `1 / n` of a
        // slot per pair, as an all-to-all's do.
        let pairs_fit = || super::shm::Routes::Pairs.capacity(piece & !63, self.size()) > 0;
        let shm_kind = matches!(
            kind,
            Kind::AllReduce | Kind::Broadcast | Kind::AllGather | Kind::AllGatherInto
        ) || kind == Kind::Reduce
            || (matches!(kind, Kind::ReduceScatter | Kind::ReduceScatterTensor) && pairs_fit());
        let shm = shm_ok && shm_kind;
        match self.cfg.algorithm {
            Algorithm::Direct => Algo::Direct,
            Algorithm::Ring => Algo::Ring,
            Algorithm::SharedMemory if shm => Algo::Shm,
            Algorithm::SharedMemory => Algo::Ring,
            // Once the segment is set up, a small call through it costs less
            // than its payloads over TCP (one barrier through the segment
            // against messages and the readers' wake-ups: a 1 KiB all-reduce
            // 0.07-0.08 against 0.17-0.19 ms with 2 processes, 0.22 against
            // 0.34-0.37 ms with 4, measured in the same minutes;
            // `docs/benchmarks.md`).
            Algorithm::Auto
                if shm
                    && size_bytes > 0
                    && (ready || size_bytes.saturating_mul(n - 1) >= self.cfg.shm_min_bytes as u64) =>
            {
                Algo::Shm
            }
            // With two members a ring reduce moves 1.5x the bytes of the direct one
            // (reduce-scatter both ways, then half to the root) for no benefit.
            Algorithm::Auto if kind == Kind::Reduce && n == 2 => Algo::Direct,
            Algorithm::Auto => {
                if size_bytes.saturating_mul(n - 1) <= self.cfg.direct_max_bytes as u64 {
                    Algo::Direct
                } else {
                    Algo::Ring
                }
            }
        }
    }

    /// Runs `fut` (which must return `Result<R>`) on a task and returns its handle.
    pub(crate) fn spawn<R, F>(fut: F) -> CollectiveHandle<R>
    where
        R: Send + 'static,
        F: Future<Output = Result<R>> + Send + 'static,
    {
        match tokio::runtime::Handle::try_current() {
            Ok(h) => CollectiveHandle::running(h.spawn(fut)),
            Err(_) => CollectiveHandle::ready(Err(Error::invalid(
                "collective handles must be created inside a Tokio runtime",
            ))),
        }
    }
}

type LockFuture = Pin<Box<dyn Future<Output = OwnedMutexGuard<GroupState>> + Send>>;

/// A call's place in its group's order.
pub(crate) enum Ticket {
    Ready(OwnedMutexGuard<GroupState>),
    Waiting(LockFuture),
}

impl Ticket {
    async fn acquire(self) -> OwnedMutexGuard<GroupState> {
        match self {
            Ticket::Ready(g) => g,
            Ticket::Waiting(f) => f.await,
        }
    }
}

/// One collective call that has its turn.
pub(crate) struct Call<'g> {
    group: &'g Group,
    guard: OwnedMutexGuard<GroupState>,
    kind: Kind,
    seq: u64,
    me: usize,
    /// Whether the agreement round goes through the segment.
    agree_in_shm: bool,
}

impl<'g> Call<'g> {
    /// The context the algorithms run with.
    pub(crate) fn ctx(&self) -> Ctx<'g> {
        let g = &self.group.inner;
        Ctx {
            comm: &g.comm,
            members: &g.members,
            me: self.me,
            seq: self.seq,
            desc_tag: collective_tag(g.id, self.seq, Phase::Descriptor),
            tag: collective_tag(g.id, self.seq, Phase::Data),
            cfg: &self.group.cfg,
            group_id: g.id,
            shm: &g.shm,
            agree_in_shm: self.agree_in_shm,
        }
    }

    /// A descriptor of this call with the common fields filled in.
    pub(crate) fn desc(&self) -> Desc {
        let g = &self.group.inner;
        Desc::new(
            self.kind,
            g.members.len(),
            self.seq,
            g.hash,
            self.group.cfg.fingerprint(),
        )
    }

    /// Chooses the algorithm and whether direct payloads go eagerly.
    /// `size_bytes`: the buffer size every member agrees on (for the crossover);
    /// `send_bytes`: what this rank sends in the direct algorithm.
    pub(crate) fn plan(&self, d: &mut Desc, size_bytes: u64, send_bytes: u64) {
        let n = self.group.size() as u64;
        d.algo = self
            .group
            .algorithm_with(self.kind, size_bytes, self.guard.shm.choice());
        // A call sized after the agreement that may use shared memory still
        // sends small payloads eagerly (and then uses TCP), unless shared
        // memory is forced.
        let direct = d.algo.runs_direct(self.kind)
            && (d.algo == Algo::Direct || self.group.cfg.algorithm == Algorithm::Auto);
        // A member that sends nothing has nothing to send early (and empty
        // messages sent eagerly would be left unread by a call that then
        // moves the others' data through shared memory).
        d.eager = direct && n > 1 && send_bytes > 0 && send_bytes <= self.group.cfg.eager_max_bytes as u64;
    }

    /// Moves the group's scratch pool out for the call (give it back with
    /// [`Call::put_scratch`]).
    pub(crate) fn take_scratch(&mut self) -> Scratch {
        std::mem::take(&mut self.guard.scratch)
    }

    pub(crate) fn put_scratch(&mut self, s: Scratch) {
        self.guard.scratch = s;
    }

    /// Lends the group's shared-memory state to the call (give it back with
    /// [`Call::put_shm`]; see [`ShmLoan`] for a call dropped meanwhile).
    pub(crate) fn lend_shm(&self) -> ShmLoan {
        ShmLoan {
            state: self.guard.shm.clone(),
            shared: Arc::clone(&self.group.inner.shm),
        }
    }

    /// Takes back the state lent with [`Call::lend_shm`] (the mark that the
    /// call uses the segment is cleared by [`Call::guard`], if the call ended
    /// by itself).
    pub(crate) fn put_shm(&mut self, loan: ShmLoan) {
        self.guard.shm = loan.state;
    }

    /// Finishes a call whose local validation failed: tells the other members (an
    /// "abstain" descriptor, no data), drains what they send for this call in the
    /// background, and returns `err`.
    ///
    /// Through the segment, the descriptor goes into this member's slot and
    /// the call waits at the agreement barrier like the others' calls (so
    /// that its next call cannot write the slot the others still read); then
    /// it drops in the background what the others sent eagerly.
    pub(crate) async fn abstain(self, err: Error) -> Error {
        let cx = self.ctx();
        let mut d = self.desc();
        d.abstain = true;
        let words = d.encode();
        let n = cx.members.len();
        if n > 1 && cx.agree_in_shm {
            if let Some(seg) = cx.shm.segment.get() {
                let mut events = self.group.inner.comm.health_events();
                if self.group.inner.member_failure().is_some() {
                    return err;
                }
                cx.shm.in_use.store(true, Ordering::Relaxed);
                let agreed = self
                    .watched(
                        async { shm::agree(n, cx.me, cx.seq, seg, &words).await },
                        &mut events,
                    )
                    .await;
                match agreed {
                    Ok(Ok(others)) => {
                        let descs = decoded_or_abstaining(others, n);
                        drop_in_background(&cx, Leftovers::Described(descs));
                        return err;
                    }
                    // A member abandoned the segment from this call on: every
                    // member agrees over TCP, this one too (below).
                    Ok(Err(no)) if cx.seq >= no.by.from => {}
                    // Abandoned before this call: the call cannot complete.
                    Ok(Err(no)) => {
                        cx.drop_arrived_eager(no.arrived);
                        return err;
                    }
                    // A lost member or the deadline.
                    Err(_) => return err,
                }
            }
        }
        for q in (0..n).filter(|&q| q != cx.me) {
            // Dropping the handle does not cancel the send.
            drop(
                cx.comm
                    .isend(cx.members[q], cx.desc_tag, Tensor::from(words.clone())),
            );
        }
        if n > 1 {
            drop_in_background(&cx, Leftovers::Undescribed);
        }
        err
    }

    /// Runs `fut` under the guard: fails at once if a member of the group is lost
    /// or the communicator aborted (before or while it runs), and applies the
    /// call's deadline.
    pub(crate) async fn guard<R>(&self, fut: impl Future<Output = Result<R>>) -> Result<R> {
        let g = &self.group.inner;
        let mut events = g.comm.health_events();
        if let Some(e) = g.member_failure() {
            return Err(e);
        }
        let op = self.kind.name();
        let local = g.comm.rank();
        debug!(rank = %local, group = g.id, seq = self.seq, op, "collective call starts");
        let observed = self.group.observer.as_ref().map(|o| o.call_started(op));
        let r = {
            // Pinned here and lent to `watched` by reference: a call's future
            // is several KiB, and moving it into `watched`'s own (which would
            // hold it twice, plain and under a deadline) cost three copies
            // of 5–15 KiB per call, about half of a small call's CPU time.
            let fut = std::pin::pin!(fut);
            self.watched(fut, &mut events).await
        };
        match &r {
            Ok(_) => debug!(rank = %local, group = g.id, seq = self.seq, op, "collective call done"),
            Err(e) => {
                debug!(rank = %local, group = g.id, seq = self.seq, op, error = %e, "collective call failed")
            }
        }
        if let Some(end) = observed {
            end.ended(r.as_ref().err());
        }
        r
    }

    /// Runs `fut` until it ends, a member of the group is lost or the
    /// communicator aborted (`events`), or the call's deadline passes; clears
    /// the mark that the call uses the segment if `fut` ended by itself.
    async fn watched<R>(
        &self,
        fut: impl Future<Output = Result<R>>,
        events: &mut broadcast::Receiver<HealthEvent>,
    ) -> Result<R> {
        let g = &self.group.inner;
        let op = self.kind.name();
        let body = async {
            match self.group.cfg.timeout.or(g.comm.config().op_timeout) {
                None => fut.await,
                Some(after) => tokio::time::timeout(after, fut)
                    .await
                    .unwrap_or(Err(Error::Timeout { op, after })),
            }
        };
        let mut body = std::pin::pin!(body);
        let r = tokio::select! {
            biased;
            r = &mut body => {
                if !matches!(r, Err(Error::Timeout { .. })) {
                    // The body ended by itself, so this member's arrivals at
                    // the segment's barriers are where the others' are (a
                    // deadline drops it wherever it is).
                    g.shm.in_use.store(false, Ordering::Relaxed);
                }
                r
            }
            e = watch(g, events) => {
                debug!(rank = %g.comm.rank(), group = g.id, seq = self.seq, op, error = %e, "collective call abandoned");
                if matches!(e, Error::Aborted { .. }) {
                    // Our own communicator was aborted: every pending operation of
                    // the body fails promptly now, and a send must see that itself
                    // to release its socket (a send future dropped while it holds a
                    // peer's writer leaves the connection open, so the peer would
                    // never learn of the abort). Drive it to its end, briefly.
                    let _ = tokio::time::timeout(ABORT_GRACE, &mut body).await;
                }
                Err(e)
            }
        };
        r
    }
}

/// How long a call keeps driving its operations after its own communicator was
/// aborted, so that they release their sockets (see [`Call::guard`]).
const ABORT_GRACE: Duration = Duration::from_millis(500);

/// Resolves with the error that ends a call: a member lost or the communicator
/// aborted.
async fn watch(g: &GroupInner, events: &mut broadcast::Receiver<HealthEvent>) -> Error {
    loop {
        match events.recv().await {
            Ok(HealthEvent::PeerLost { rank, cause }) => {
                if g.members.contains(&rank) {
                    return Error::PeerLost { rank, cause };
                }
            }
            Ok(HealthEvent::Aborted { reason }) => return Error::Aborted { reason },
            // Other events (present or future variants) do not end a call.
            #[allow(unreachable_patterns)]
            Ok(_) => {}
            Err(RecvError::Lagged(_)) => {
                if let Some(e) = g.member_failure() {
                    return e;
                }
            }
            Err(RecvError::Closed) => {
                if let Some(e) = g.member_failure() {
                    return e;
                }
                // No more events can come; leave the call to its own outcome.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Waits for the sends an exchange started (descriptors, eager payloads).
pub(crate) async fn finish_sends(sends: Vec<SendHandle>) -> Result<()> {
    try_join_all(sends.into_iter().map(SendHandle::wait))
        .await
        .map(|_| ())
}

/// What the algorithms of one call need: the communicator, the members, this
/// rank's position, the call's tags and the settings.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'g> {
    pub comm: &'g Arc<Communicator>,
    pub members: &'g [Rank],
    pub me: usize,
    /// The call's sequence number in its group.
    pub seq: u64,
    pub desc_tag: Tag,
    pub tag: Tag,
    pub cfg: &'g CollectiveConfig,
    pub group_id: u16,
    /// The group's segment (once set up) and the mark that the call uses it.
    pub shm: &'g ShmShared,
    /// Whether the agreement round goes through the segment (see
    /// `Group::begin`).
    pub agree_in_shm: bool,
}

/// The descriptors read from the segment (`None`: this member's place) as
/// [`Desc`]s; this member's place and any descriptor that does not decode
/// become an abstaining placeholder, which sends nothing.
fn decoded_or_abstaining(words: Vec<Option<Vec<u64>>>, n: usize) -> Vec<Desc> {
    words
        .into_iter()
        .map(|w| {
            w.and_then(|w| Desc::decode(&w, n).ok())
                .unwrap_or_else(|| abstaining(n))
        })
        .collect()
}

/// A descriptor that sends nothing (a placeholder in a group of `n`).
fn abstaining(n: usize) -> Desc {
    let mut d = Desc::new(Kind::Barrier, n, 0, 0, 0);
    d.abstain = true;
    d
}

/// What the other members sent this member for a call it leaves early.
enum Leftovers {
    /// Their descriptors (over TCP), and what they say was sent eagerly.
    Undescribed,
    /// What the descriptors of the members that agreed through the segment
    /// say was sent eagerly.
    Described(Vec<Desc>),
}

/// Receives and drops, on a task of its own, the `leftovers` of `cx`'s call.
fn drop_in_background(cx: &Ctx<'_>, leftovers: Leftovers) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        let comm = Arc::clone(cx.comm);
        let members = cx.members.to_vec();
        let (me, desc_tag, tag) = (cx.me, cx.desc_tag, cx.tag);
        rt.spawn(async move {
            let (cfg, shm) = (CollectiveConfig::default(), ShmShared::default());
            let cx = Ctx::detached(&comm, &members, me, desc_tag, tag, &cfg, &shm);
            let _ = match leftovers {
                Leftovers::Undescribed => cx.drain().await,
                Leftovers::Described(descs) => cx.drop_eager(&descs).await,
            };
        });
    }
}

impl<'g> Ctx<'g> {
    /// A context outside any call of a group, for a task that only receives
    /// a call's leftovers over TCP.
    fn detached(
        comm: &'g Arc<Communicator>,
        members: &'g [Rank],
        me: usize,
        desc_tag: Tag,
        tag: Tag,
        cfg: &'g CollectiveConfig,
        shm: &'g ShmShared,
    ) -> Ctx<'g> {
        Ctx {
            comm,
            members,
            me,
            seq: 0,
            desc_tag,
            tag,
            cfg,
            group_id: 0,
            shm,
            agree_in_shm: false,
        }
    }

    pub(crate) fn n(&self) -> usize {
        self.members.len()
    }

    pub(crate) fn next(&self) -> usize {
        (self.me + 1) % self.n()
    }

    pub(crate) fn prev(&self) -> usize {
        (self.me + self.n() - 1) % self.n()
    }

    /// Members other than this rank, by index.
    pub(crate) fn peers(&self) -> impl Iterator<Item = usize> + use<> {
        let me = self.me;
        (0..self.n()).filter(move |&p| p != me)
    }

    pub(crate) async fn send<'a>(&self, to: usize, data: impl Into<TensorView<'a>>) -> Result<()> {
        self.comm.send(self.members[to], self.tag, data).await
    }

    pub(crate) async fn recv(&self, from: usize, buf: &mut Tensor) -> Result<()> {
        self.comm.recv(self.members[from], self.tag, buf).await
    }

    pub(crate) fn irecv(&self, from: usize, buf: Tensor) -> RecvHandle {
        self.comm.irecv(Source::Rank(self.members[from]), self.tag, buf)
    }

    /// Receives a message from `from` into `t` (owned) and returns it.
    pub(crate) async fn recv_new(&self, from: usize, t: Tensor) -> Result<Tensor> {
        let Received { tensor, .. } = self.irecv(from, t).wait().await?;
        Ok(tensor)
    }

    /// Elements per pipeline chunk for `dtype`.
    pub(crate) fn chunk_elems(&self, dtype: DType) -> usize {
        (self.cfg.chunk_bytes / dtype.size()).max(1)
    }

    /// Sends each `(member, view)`, concurrently.
    pub(crate) async fn send_all(&self, payloads: &[(usize, TensorView<'_>)]) -> Result<()> {
        try_join_all(payloads.iter().map(|&(q, v)| self.send(q, v)))
            .await
            .map(|_| ())
    }

    /// The agreement round: sends `mine` to every other member (and, if
    /// `mine.eager`, the direct `payloads` right behind it, copied), receives
    /// theirs, and checks that everybody made the same call. On disagreement it
    /// receives and drops what the others sent eagerly, then fails. Returns every
    /// member's descriptor and the pending sends (await them with
    /// [`finish_sends`]).
    pub(crate) async fn exchange(
        &self,
        mine: &Desc,
        payloads: &[(usize, TensorView<'_>)],
    ) -> Result<(Vec<Desc>, Vec<SendHandle>)> {
        let n = self.n();
        if n == 1 {
            return Ok((vec![mine.clone()], Vec::new()));
        }
        let words = mine.encode();
        let eager: &[(usize, TensorView<'_>)] = if mine.eager { payloads } else { &[] };
        let mut sends = Vec::new();
        let got = match self.shm.segment.get().filter(|_| self.agree_in_shm) {
            None => self.tcp_round(&words, eager, &mut sends).await?,
            Some(seg) => {
                // The payloads go first, as over TCP: a call dropped while it
                // waits for the others has still sent them, and the others
                // receive them whatever the check finds (and drop them on
                // disagreement). Copied before the call marks the segment in
                // use: a failed copy must not leave it marked without an
                // arrival.
                let copies = eager
                    .iter()
                    .map(|&(q, v)| Ok((q, Tensor::from_bytes(v.dtype(), [v.numel()], v.as_bytes())?)))
                    .collect::<Result<Vec<_>>>()?;
                self.shm.in_use.store(true, Ordering::Relaxed);
                for (q, copy) in copies {
                    sends.push(self.comm.isend(self.members[q], self.tag, copy));
                }
                match shm::agree(n, self.me, self.seq, seg, &words).await? {
                    Ok(others) => others
                        .into_iter()
                        .enumerate()
                        .filter_map(|(p, w)| Some((p, w?)))
                        .collect(),
                    // A member abandoned the segment from this call on (it
                    // agrees over TCP): so does every member.
                    Err(no) if self.seq >= no.by.from => self.tcp_round(&words, &[], &mut sends).await?,
                    Err(no) => {
                        self.drop_arrived_eager(no.arrived);
                        return Err(no.by.error(self.members));
                    }
                }
            }
        };
        let mut descs: Vec<Option<Desc>> = vec![None; n];
        descs[self.me] = Some(mine.clone());
        for (p, w) in got {
            let d = Desc::decode(&w, n).map_err(|e| {
                Error::invalid(format!(
                    "malformed collective descriptor from rank {}: {e}",
                    self.members[p]
                ))
            })?;
            descs[p] = Some(d);
        }
        let descs: Vec<Desc> = descs.into_iter().flatten().collect();
        let agreed = desc::agree(
            &descs,
            &AgreeCtx {
                members: self.members,
                me: self.me,
                group_id: self.group_id,
                data_tag: self.tag,
                max_object_bytes: self.cfg.max_object_bytes as u64,
            },
        );
        if let Err(e) = agreed {
            // Leave nothing behind: take what the others already sent us.
            let _ = self.drop_eager(&descs).await;
            return Err(e);
        }
        Ok((descs, sends))
    }

    /// After an agreement round through the segment that could not complete:
    /// drops, in the background, what the members that had arrived (their
    /// descriptors `arrived`, read from the segment) sent this member eagerly,
    /// so nothing of the call is left unread.
    fn drop_arrived_eager(&self, arrived: Vec<Option<Vec<u64>>>) {
        let n = self.n();
        let descs = decoded_or_abstaining(arrived, n)
            .into_iter()
            .map(|d| if d.seq == self.seq { d } else { abstaining(n) })
            .collect();
        drop_in_background(self, Leftovers::Described(descs));
    }

    /// Starts sending a copy of `v` to member `q` on `tag`.
    fn send_copy(&self, q: usize, tag: Tag, v: TensorView<'_>) -> Result<SendHandle> {
        let copy = Tensor::from_bytes(v.dtype(), [v.numel()], v.as_bytes())?;
        Ok(self.comm.isend(self.members[q], tag, copy))
    }

    /// The descriptor round over TCP: sends `words` to every other member,
    /// each followed by the `eager` payloads for it (adding the sends to
    /// `sends`), and returns theirs.
    async fn tcp_round(
        &self,
        words: &[u64],
        eager: &[(usize, TensorView<'_>)],
        sends: &mut Vec<SendHandle>,
    ) -> Result<Vec<(usize, Vec<u64>)>> {
        let len = desc::words(self.n());
        let recvs: Vec<(usize, RecvHandle)> = self
            .peers()
            .map(|p| {
                Ok((
                    p,
                    self.comm
                        .irecv(self.members[p], self.desc_tag, Tensor::zeros(DType::U64, [len])?),
                ))
            })
            .collect::<Result<_>>()?;
        for q in self.peers() {
            sends.push(
                self.comm
                    .isend(self.members[q], self.desc_tag, Tensor::from(words.to_vec())),
            );
            for &(_, v) in eager.iter().filter(|(to, _)| *to == q) {
                sends.push(self.send_copy(q, self.tag, v)?);
            }
        }
        try_join_all(recvs.into_iter().map(|(p, h)| async move {
            let r = h.wait().await?;
            Ok((p, r.tensor.as_slice::<u64>()?.to_vec()))
        }))
        .await
    }

    /// Receives and drops the eager payloads the members described by `descs` sent
    /// to this rank.
    async fn drop_eager(&self, descs: &[Desc]) -> Result<()> {
        let limit = self.comm.config().limits.max_message_bytes;
        let expected: Vec<(usize, DType, u64)> = self
            .peers()
            .filter_map(|p| {
                desc::eager_payload(descs.get(p)?, p, self.me, self.members).map(|(d, c)| (p, d, c))
            })
            .filter(|(_, d, c)| c.saturating_mul(d.size() as u64) <= limit)
            .collect();
        try_join_all(expected.into_iter().map(|(p, d, c)| async move {
            let buf = Tensor::zeros(d, [usize::try_from(c).unwrap_or(usize::MAX)])?;
            self.recv_new(p, buf).await.map(drop)
        }))
        .await
        .map(|_| ())
    }

    /// After this rank abstained: receives every other member's descriptor for the
    /// call and drops whatever they sent eagerly.
    async fn drain(&self) -> Result<()> {
        let n = self.n();
        let len = desc::words(n);
        let got = try_join_all(self.peers().map(|p| async move {
            let buf = Tensor::zeros(DType::U64, [len])?;
            let t = self
                .comm
                .irecv(self.members[p], self.desc_tag, buf)
                .wait()
                .await?
                .tensor;
            Ok((p, t.as_slice::<u64>()?.to_vec()))
        }))
        .await?;
        let mut words = vec![None; n];
        for (p, w) in got {
            words[p] = Some(w);
        }
        let descs = decoded_or_abstaining(words, n);
        self.drop_eager(&descs).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ids_propose_past_what_is_taken_and_claim_each_id_once() {
        let mut ids = GroupIds::default();
        assert!(!ids.claim(0), "the world group's id is taken");
        assert_eq!(ids.propose(), 1);
        // Another member proposed more: the agreed id is 3.
        assert!(ids.claim(3));
        assert_eq!(ids.propose(), 4, "proposals go on past an agreed id");
        // A group created at the same time from another parent agreed on 3
        // too: this member refuses it.
        assert!(!ids.claim(3));
        // An id claimed for a group another member refused is free again,
        // but proposals do not go back to it.
        assert!(ids.claim(7));
        ids.release(7);
        assert!(!ids.is_taken(7));
        assert_eq!(ids.propose(), 8);
        assert!(ids.claim(7), "a released id can be agreed on again");
        assert!(ids.claim(9));
        let mut ids2 = GroupIds::default();
        assert!(ids2.claim(2));
        ids2.next = 2;
        assert_eq!(ids2.propose(), 3, "a proposal skips an id it has given out");
    }

    #[test]
    fn a_retry_proposal_skips_ids_and_what_is_taken() {
        let mut ids = GroupIds::default();
        assert!(ids.claim(5));
        assert_eq!(ids.propose_from(3), 9, "6 + 3");
        assert!(ids.claim(12));
        ids.next = 10;
        assert_eq!(ids.propose_from(2), 13, "12 is taken");
        assert!(ids.propose_from(u16::MAX) > MAX_GROUP_ID);
    }

    #[test]
    fn group_ids_run_out_at_the_largest_id() {
        let mut ids = GroupIds::default();
        assert!(ids.claim(MAX_GROUP_ID));
        assert!(ids.propose() > MAX_GROUP_ID);
        assert!(!ids.claim(MAX_GROUP_ID + 1), "beyond the largest id");
        assert!(!ids.claim(u16::MAX));
        assert!(ids.propose() > MAX_GROUP_ID, "and stays there");
        let mut fresh = GroupIds::default();
        for id in 1..=MAX_GROUP_ID {
            assert_eq!(fresh.propose(), id);
            assert!(fresh.claim(id));
        }
        assert!(fresh.propose() > MAX_GROUP_ID);
    }
}
