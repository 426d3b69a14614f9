//! Call descriptors and the agreement check (pure, no I/O). Before a collective
//! moves data, every member sends every other member a descriptor of its call
//! (kind, dtype, element counts, root, reduce op, the algorithm it chose, and a
//! fingerprint of its configuration) as one small `u64` message. Every member then
//! holds all descriptors and runs the same deterministic [`agree`] over them, so
//! either every member goes on or every member returns an error (the same error
//! text on every rank, except that [`Error::Mismatch`] names the first rank whose
//! dtype or size differs from the caller's).
//!
//! A descriptor also says what its sender already sent "eagerly" (small payloads
//! of direct algorithms ride right behind the descriptor, to save a round trip):
//! on disagreement each member receives and drops exactly those messages, so no
//! stray message is left behind and the group stays usable.
//!
//! Layout (little-endian `u64` words; `n` is the group size):
//!
//! | word | content |
//! |---|---|
//! | 0 | magic `"MWCOLL"` + version 1 |
//! | 1 | kind (bits 0–7), flags (8–15: 1 abstain, 2 eager), dtype code (16–23, 0 none), reduce op code (24–31, 0 none), algorithm (32–39) |
//! | 2 | root (world rank; `u64::MAX` none) |
//! | 3 | call sequence number |
//! | 4 | hash of the group's member list |
//! | 5 | configuration fingerprint |
//! | 6 | count (the main element count, or an object's byte length) |
//! | 7 | aux (op-specific) |
//! | 8 .. 8+n | `a[i]` per member (op-specific counts) |
//! | 8+n .. 8+2n | `b[i]` per member (op-specific counts) |

use std::fmt::Write as _;

use multiworld_tcp::{Error, MessageDesc, Result};
use multiworld_types::DType;
use multiworld_types::ReduceOp;
use multiworld_types::{Rank, Tag};

const MAGIC: u64 = 0x4d57_434f_4c4c_0001;
/// Words before the per-member arrays.
pub(crate) const HEADER_WORDS: usize = 8;
const FLAG_ABSTAIN: u64 = 1;
const FLAG_EAGER: u64 = 2;
const NO_ROOT: u64 = u64::MAX;

/// Which collective a call is (exported as `CollectiveKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `barrier`.
    Barrier,
    /// `broadcast`.
    Broadcast,
    /// `reduce`.
    Reduce,
    /// `all_reduce`.
    AllReduce,
    /// `all_gather` into a list.
    AllGather,
    /// `all_gather_into_tensor`.
    AllGatherInto,
    /// `gather`.
    Gather,
    /// `scatter`.
    Scatter,
    /// `reduce_scatter` from a list.
    ReduceScatter,
    /// `reduce_scatter_tensor`.
    ReduceScatterTensor,
    /// `all_to_all` of lists.
    AllToAll,
    /// `all_to_all_single` (one tensor, optional uneven splits).
    AllToAllSingle,
    /// `broadcast_object`.
    BroadcastObject,
    /// `all_gather_object`.
    AllGatherObject,
    /// `gather_object`.
    GatherObject,
    /// `scatter_object`.
    ScatterObject,
    /// `new_group` (the agreement on a sub-group).
    NewGroup,
}

impl Kind {
    /// Every kind (the codec's table; the fuzzers draw from it too).
    pub(crate) const ALL: [Kind; 17] = [
        Kind::Barrier,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllReduce,
        Kind::AllGather,
        Kind::AllGatherInto,
        Kind::Gather,
        Kind::Scatter,
        Kind::ReduceScatter,
        Kind::ReduceScatterTensor,
        Kind::AllToAll,
        Kind::AllToAllSingle,
        Kind::BroadcastObject,
        Kind::AllGatherObject,
        Kind::GatherObject,
        Kind::ScatterObject,
        Kind::NewGroup,
    ];

    fn code(self) -> u8 {
        match self {
            Kind::Barrier => 1,
            Kind::Broadcast => 2,
            Kind::Reduce => 3,
            Kind::AllReduce => 4,
            Kind::AllGather => 5,
            Kind::AllGatherInto => 6,
            Kind::Gather => 7,
            Kind::Scatter => 8,
            Kind::ReduceScatter => 9,
            Kind::ReduceScatterTensor => 10,
            Kind::AllToAll => 11,
            Kind::AllToAllSingle => 12,
            Kind::BroadcastObject => 13,
            Kind::AllGatherObject => 14,
            Kind::GatherObject => 15,
            Kind::ScatterObject => 16,
            Kind::NewGroup => 17,
        }
    }

    fn from_code(code: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// The torch-style name, used in errors and `Timeout { op }`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Barrier => "barrier",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllReduce => "all_reduce",
            Kind::AllGather => "all_gather",
            Kind::AllGatherInto => "all_gather_into_tensor",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::ReduceScatterTensor => "reduce_scatter_tensor",
            Kind::AllToAll => "all_to_all",
            Kind::AllToAllSingle => "all_to_all_single",
            Kind::BroadcastObject => "broadcast_object",
            Kind::AllGatherObject => "all_gather_object",
            Kind::GatherObject => "gather_object",
            Kind::ScatterObject => "scatter_object",
            Kind::NewGroup => "new_group",
        }
    }

    fn has_root(self) -> bool {
        matches!(
            self,
            Kind::Broadcast
                | Kind::Reduce
                | Kind::Gather
                | Kind::Scatter
                | Kind::BroadcastObject
                | Kind::GatherObject
                | Kind::ScatterObject
        )
    }

    fn has_op(self) -> bool {
        matches!(
            self,
            Kind::Reduce | Kind::AllReduce | Kind::ReduceScatter | Kind::ReduceScatterTensor
        )
    }

    fn has_dtype(self) -> bool {
        !matches!(self, Kind::Barrier | Kind::NewGroup) && !self.is_object()
    }

    fn is_object(self) -> bool {
        matches!(
            self,
            Kind::BroadcastObject | Kind::AllGatherObject | Kind::GatherObject | Kind::ScatterObject
        )
    }

    /// Kinds whose members learn each other's sizes only from the descriptors:
    /// whether such a call moves its data through shared memory is decided
    /// after the agreement (see `shm::plan_moves`).
    pub(crate) fn sized_after_agreement(self) -> bool {
        matches!(
            self,
            Kind::Gather | Kind::Scatter | Kind::AllToAll | Kind::AllToAllSingle
        )
    }

    /// Kinds whose main count must be equal on every member.
    fn uniform_count(self) -> bool {
        matches!(
            self,
            Kind::Broadcast
                | Kind::Reduce
                | Kind::AllReduce
                | Kind::AllGatherInto
                | Kind::ReduceScatterTensor
        )
    }
}

/// The algorithm a call runs. Part of the agreement, so ranks whose configuration
/// would pick different algorithms get an error instead of a hang.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Algo {
    /// Every member exchanges directly with the members it needs (one round).
    Direct,
    /// Ring reduce-scatter / all-gather, or a pipelined chain for broadcast.
    Ring,
    /// Same-host shared memory (see `shm.rs`). For kinds sized after the
    /// agreement ([`Kind::sized_after_agreement`]): the call may use it, and
    /// sends small payloads eagerly as a direct one would.
    Shm,
}

impl Algo {
    fn code(self) -> u8 {
        match self {
            Algo::Direct => 1,
            Algo::Ring => 2,
            Algo::Shm => 3,
        }
    }

    fn from_code(c: u8) -> Option<Algo> {
        match c {
            1 => Some(Algo::Direct),
            2 => Some(Algo::Ring),
            3 => Some(Algo::Shm),
            _ => None,
        }
    }

    /// Whether a call of `kind` planned on this algorithm runs the direct
    /// exchange (and so may send its payloads eagerly): `Direct`, and `Shm`
    /// for kinds sized after the agreement, which fall back to it.
    pub(crate) fn runs_direct(self, kind: Kind) -> bool {
        match self {
            Algo::Direct => true,
            Algo::Shm => kind.sized_after_agreement(),
            Algo::Ring => false,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Algo::Direct => "direct",
            Algo::Ring => "ring",
            Algo::Shm => "shm",
        }
    }
}

/// One member's description of its call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Desc {
    pub kind: Kind,
    /// The sender rejected its own call (invalid arguments); it sends no data.
    pub abstain: bool,
    /// The sender's direct payloads follow the descriptor without waiting.
    pub eager: bool,
    pub algo: Algo,
    pub dtype: Option<DType>,
    pub op: Option<ReduceOp>,
    pub root: Option<Rank>,
    pub seq: u64,
    pub group: u64,
    pub config: u64,
    pub count: u64,
    pub aux: u64,
    pub a: Vec<u64>,
    pub b: Vec<u64>,
}

/// Number of `u64` words of a descriptor in a group of `n`.
pub(crate) fn words(n: usize) -> usize {
    HEADER_WORDS + 2 * n
}

impl Desc {
    /// A descriptor with empty fields for a group of `n`.
    pub(crate) fn new(kind: Kind, n: usize, seq: u64, group: u64, config: u64) -> Desc {
        Desc {
            kind,
            abstain: false,
            eager: false,
            algo: Algo::Direct,
            dtype: None,
            op: None,
            root: None,
            seq,
            group,
            config,
            count: 0,
            aux: 0,
            a: vec![0; n],
            b: vec![0; n],
        }
    }

    pub(crate) fn encode(&self) -> Vec<u64> {
        let mut w = Vec::with_capacity(HEADER_WORDS + self.a.len() + self.b.len());
        let flags = if self.abstain { FLAG_ABSTAIN } else { 0 } | if self.eager { FLAG_EAGER } else { 0 };
        w.push(MAGIC);
        w.push(
            u64::from(self.kind.code())
                | flags << 8
                | u64::from(self.dtype.map_or(0, DType::code)) << 16
                | u64::from(self.op.map_or(0, ReduceOp::code)) << 24
                | u64::from(self.algo.code()) << 32,
        );
        w.push(self.root.map_or(NO_ROOT, |r| u64::from(r.0)));
        w.push(self.seq);
        w.push(self.group);
        w.push(self.config);
        w.push(self.count);
        w.push(self.aux);
        w.extend_from_slice(&self.a);
        w.extend_from_slice(&self.b);
        w
    }

    /// Decodes a descriptor of a group of `n`; the error says what is wrong.
    pub(crate) fn decode(w: &[u64], n: usize) -> std::result::Result<Desc, String> {
        if w.len() != words(n) {
            return Err(format!("descriptor has {} words, expected {}", w.len(), words(n)));
        }
        if w[0] != MAGIC {
            return Err(format!("bad descriptor magic {:#x}", w[0]));
        }
        let p = w[1];
        let byte = |shift: u32| ((p >> shift) & 0xff) as u8;
        let kind = Kind::from_code(byte(0)).ok_or_else(|| format!("unknown collective kind {}", byte(0)))?;
        let flags = u64::from(byte(8));
        let dtype = match byte(16) {
            0 => None,
            c => Some(DType::from_code(c).ok_or_else(|| format!("unknown dtype code {c}"))?),
        };
        let op = match byte(24) {
            0 => None,
            c => Some(ReduceOp::from_code(c).ok_or_else(|| format!("unknown reduce op code {c}"))?),
        };
        let algo = Algo::from_code(byte(32)).ok_or_else(|| format!("unknown algorithm {}", byte(32)))?;
        let root = match w[2] {
            NO_ROOT => None,
            r => Some(Rank(
                u32::try_from(r).map_err(|_| format!("root {r} out of range"))?,
            )),
        };
        Ok(Desc {
            kind,
            abstain: flags & FLAG_ABSTAIN != 0,
            eager: flags & FLAG_EAGER != 0,
            algo,
            dtype,
            op,
            root,
            seq: w[3],
            group: w[4],
            config: w[5],
            count: w[6],
            aux: w[7],
            a: w[HEADER_WORDS..HEADER_WORDS + n].to_vec(),
            b: w[HEADER_WORDS + n..HEADER_WORDS + 2 * n].to_vec(),
        })
    }

    /// The root's member index, if the call has a root among `members`.
    pub(crate) fn root_index(&self, members: &[Rank]) -> Option<usize> {
        self.root.and_then(|r| members.iter().position(|&m| m == r))
    }
}

/// The message (dtype, element count) that the member at index `from`, whose
/// descriptor is `d`, sent eagerly to the member at index `to`, if any. Every
/// collective sends at most one data message per ordered pair in its direct
/// algorithm.
pub(crate) fn eager_payload(d: &Desc, from: usize, to: usize, members: &[Rank]) -> Option<(DType, u64)> {
    if d.abstain || !d.eager || !d.algo.runs_direct(d.kind) || from == to {
        return None;
    }
    let bytes = DType::U8;
    let root = d.root_index(members);
    let is_root = root == Some(from);
    let to_root = root == Some(to);
    let at = |v: &Vec<u64>| v.get(to).copied();
    match d.kind {
        Kind::Barrier | Kind::NewGroup => None,
        Kind::Broadcast => is_root.then_some((d.dtype?, d.count)),
        Kind::Reduce | Kind::Gather => (!is_root && to_root).then_some((d.dtype?, d.count)),
        Kind::AllReduce | Kind::AllGather | Kind::AllGatherInto => Some((d.dtype?, d.count)),
        Kind::Scatter => is_root.then_some((d.dtype?, at(&d.a)?)),
        Kind::ReduceScatter | Kind::AllToAll | Kind::AllToAllSingle => Some((d.dtype?, at(&d.a)?)),
        Kind::ReduceScatterTensor => Some((d.dtype?, d.count)),
        Kind::BroadcastObject => is_root.then_some((bytes, d.count)),
        Kind::AllGatherObject => Some((bytes, d.count)),
        Kind::GatherObject => (!is_root && to_root).then_some((bytes, d.count)),
        Kind::ScatterObject => is_root.then_some((bytes, at(&d.a)?)),
    }
}

/// What the agreement check needs besides the descriptors.
pub(crate) struct AgreeCtx<'a> {
    pub members: &'a [Rank],
    pub me: usize,
    pub group_id: u16,
    pub data_tag: Tag,
    pub max_object_bytes: u64,
}

/// Checks that every member made the same call. Deterministic in `descs` (the same
/// on every member), except that [`Error::Mismatch`] is relative to the caller.
pub(crate) fn agree(descs: &[Desc], cx: &AgreeCtx<'_>) -> Result<()> {
    let Some(mine) = descs.get(cx.me) else {
        return Err(Error::invalid("internal: own descriptor missing"));
    };
    let kind = mine.kind;
    let prefix = format!("{} on group {} (call #{})", kind.name(), cx.group_id, mine.seq);
    let ranks = cx.members;
    let abstained: Vec<Rank> = descs
        .iter()
        .enumerate()
        .filter(|(_, d)| d.abstain)
        .map(|(i, _)| ranks[i])
        .collect();
    if !abstained.is_empty() {
        return Err(Error::invalid(format!(
            "{prefix}: rank(s) {} rejected their own call as invalid (see the error on those ranks); no data was exchanged",
            list(&abstained)
        )));
    }
    let differ = |what: &str, show: &dyn Fn(&Desc) -> String| -> Error {
        let mut s = format!("{prefix}: ranks disagree on {what}:");
        for (i, d) in descs.iter().enumerate().take(16) {
            let _ = write!(s, " rank {}: {};", ranks[i], show(d));
        }
        if descs.len() > 16 {
            s.push_str(" ...");
        }
        Error::invalid(s.trim_end_matches(';').to_owned())
    };
    let all_eq = |f: &dyn Fn(&Desc) -> u64| descs.iter().all(|d| f(d) == f(mine));
    if !descs.iter().all(|d| d.kind == kind) {
        return Err(differ("the operation", &|d| d.kind.name().to_owned()));
    }
    if !all_eq(&|d| d.seq) || !all_eq(&|d| d.group) {
        return Err(differ(
            "the group or call number (groups created in different orders?)",
            &|d| format!("group hash {:#x}, call #{}", d.group, d.seq),
        ));
    }
    if kind.has_root() && !descs.iter().all(|d| d.root == mine.root) {
        return Err(differ("the root", &|d| {
            d.root.map_or_else(|| "none".to_owned(), |r| r.to_string())
        }));
    }
    if kind.has_op() && !descs.iter().all(|d| d.op == mine.op) {
        return Err(differ("the reduce op", &|d| {
            d.op.map_or("none", ReduceOp::name).to_owned()
        }));
    }
    let msg = |d: &Desc| MessageDesc {
        dtype: d.dtype.unwrap_or(DType::U8),
        bytes: d.count.saturating_mul(d.dtype.map_or(1, |t| t.size() as u64)),
    };
    let mismatch = |i: usize| Error::Mismatch {
        peer: ranks[i],
        tag: cx.data_tag,
        expected: msg(mine),
        got: msg(&descs[i]),
    };
    if kind.has_dtype() {
        if let Some(i) = descs.iter().position(|d| d.dtype != mine.dtype) {
            return Err(mismatch(i));
        }
    }
    if kind.uniform_count() {
        if let Some(i) = descs.iter().position(|d| d.count != mine.count) {
            return Err(mismatch(i));
        }
    }
    let n = descs.len();
    let counts = |what: &str, bad: Option<(usize, usize, u64, u64)>| -> Result<()> {
        match bad {
            None => Ok(()),
            Some((q, p, expected, sent)) => Err(Error::invalid(format!(
                "{prefix}: ranks disagree on {what}: rank {} expects {expected} from rank {}, which sends {sent}",
                ranks[q], ranks[p]
            ))),
        }
    };
    // Before the checks below that use this member's own settings (the
    // object size limit): with settings that differ, every member must fail
    // with the same text, this one.
    if !descs.iter().all(|d| d.config == mine.config) {
        return Err(differ("the algorithm (their CollectiveConfig differs)", &|d| {
            format!("{} (config {:#x})", d.algo.name(), d.config)
        }));
    }
    let root = mine.root_index(ranks);
    match kind {
        Kind::AllGather => {
            // Member q expects a[p] elements from p, which contributes count_p.
            let bad = pairs(n).find(|&(q, p)| descs[q].a[p] != descs[p].count);
            counts(
                "element counts",
                bad.map(|(q, p)| (q, p, descs[q].a[p], descs[p].count)),
            )?;
        }
        Kind::Gather => {
            if let Some(r) = root {
                let bad = (0..n).find(|&p| descs[r].a[p] != descs[p].count);
                counts(
                    "element counts",
                    bad.map(|p| (r, p, descs[r].a[p], descs[p].count)),
                )?;
            }
        }
        Kind::Scatter => {
            if let Some(r) = root {
                let bad = (0..n).find(|&p| descs[r].a[p] != descs[p].count);
                counts(
                    "element counts",
                    bad.map(|p| (p, r, descs[p].count, descs[r].a[p])),
                )?;
            }
        }
        Kind::ReduceScatter => {
            if !descs.iter().all(|d| d.a == mine.a) {
                return Err(differ("the input sizes", &|d| format!("{:?}", d.a)));
            }
            if let Some(p) = (0..n).find(|&p| descs[p].count != mine.a[p]) {
                return Err(Error::invalid(format!(
                    "{prefix}: rank {} has an output of {} elements but the inputs give it {}",
                    ranks[p], descs[p].count, mine.a[p]
                )));
            }
        }
        Kind::AllToAll | Kind::AllToAllSingle => {
            // p sends a_p[q] to q, which expects b_q[p].
            let bad = pairs(n).find(|&(q, p)| descs[p].a[q] != descs[q].b[p]);
            counts(
                "split sizes",
                bad.map(|(q, p)| (q, p, descs[q].b[p], descs[p].a[q])),
            )?;
        }
        Kind::BroadcastObject | Kind::GatherObject | Kind::AllGatherObject => {
            let senders: Vec<usize> = match kind {
                Kind::BroadcastObject => root.into_iter().collect(),
                _ => (0..n).collect(),
            };
            if let Some(&p) = senders.iter().find(|&&p| descs[p].count > cx.max_object_bytes) {
                return Err(Error::invalid(format!(
                    "{prefix}: rank {} sends an object of {} bytes, above max_object_bytes ({})",
                    ranks[p], descs[p].count, cx.max_object_bytes
                )));
            }
        }
        Kind::ScatterObject => {
            if let Some(r) = root {
                if let Some(q) = (0..n).find(|&q| descs[r].a[q] > cx.max_object_bytes) {
                    return Err(Error::invalid(format!(
                        "{prefix}: the root sends rank {} an object of {} bytes, above max_object_bytes ({})",
                        ranks[q], descs[r].a[q], cx.max_object_bytes
                    )));
                }
            }
        }
        Kind::NewGroup if !all_eq(&|d| d.aux) => {
            return Err(differ("the member list", &|d| format!("hash {:#x}", d.aux)));
        }
        _ => {}
    }
    // The settings agree (checked above): a different algorithm comes from
    // shared memory being off on some members only.
    if !descs.iter().all(|d| d.algo == mine.algo) {
        return Err(differ(
            "the algorithm (same CollectiveConfig: shared memory is off on some members only, after a cancelled call that used it)",
            &|d| format!("{} (config {:#x})", d.algo.name(), d.config),
        ));
    }
    Ok(())
}

/// All ordered pairs `(q, p)` of member indices (including `q == p`, which local
/// validation already made consistent).
fn pairs(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).flat_map(move |q| (0..n).map(move |p| (q, p)))
}

fn list(ranks: &[Rank]) -> String {
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

/// FNV-1a over the members' ranks: identifies a member list.
pub(crate) fn hash_ranks(ranks: &[Rank]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for r in ranks {
        for b in r.0.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h ^ ranks.len() as u64
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn base(kind: Kind, n: usize) -> Desc {
        Desc::new(kind, n, 7, 0xabc, 0x55)
    }

    fn cx(members: &[Rank], me: usize) -> AgreeCtx<'_> {
        AgreeCtx {
            members,
            me,
            group_id: 0,
            data_tag: Tag(0x8000_0001),
            max_object_bytes: 1 << 20,
        }
    }

    #[test]
    fn roundtrip() {
        let mut d = base(Kind::AllToAllSingle, 3);
        d.dtype = Some(DType::BF16);
        d.op = Some(ReduceOp::BXor);
        d.root = Some(Rank(2));
        d.eager = true;
        d.algo = Algo::Ring;
        d.count = 99;
        d.aux = 5;
        d.a = vec![1, 2, 3];
        d.b = vec![4, 5, 6];
        let w = d.encode();
        assert_eq!(w.len(), words(3));
        assert_eq!(Desc::decode(&w, 3).unwrap(), d);
        assert!(Desc::decode(&w, 4).is_err());
        let mut bad = w.clone();
        bad[0] ^= 1;
        assert!(Desc::decode(&bad, 3).is_err());
        let mut bad = w;
        bad[1] |= 0xff;
        assert!(Desc::decode(&bad, 3).is_err());
        for k in Kind::ALL {
            assert_eq!(Kind::from_code(k.code()), Some(k));
        }
    }

    fn all_reduce(count: u64, dtype: DType, op: ReduceOp) -> Desc {
        let mut d = base(Kind::AllReduce, 3);
        d.dtype = Some(dtype);
        d.count = count;
        d.op = Some(op);
        d
    }

    /// Members whose settings differ (here their object size limits) fail
    /// with the same text, not each with its own limit's verdict.
    #[test]
    fn differing_settings_fail_with_one_text_on_every_member() {
        let m = [Rank(0), Rank(1)];
        let mut v = vec![base(Kind::AllGatherObject, 2); 2];
        for d in &mut v {
            d.count = 2 << 20;
        }
        v[1].config = 0x66;
        let strict = cx(&m, 0);
        let mut lenient = cx(&m, 1);
        lenient.max_object_bytes = 4 << 20;
        let a = agree(&v, &strict).unwrap_err().to_string();
        let b = agree(&v, &lenient).unwrap_err().to_string();
        assert!(a.contains("CollectiveConfig differs"), "{a}");
        assert_eq!(a, b);
    }

    #[test]
    fn agreement_and_disagreement() {
        let m = [Rank(0), Rank(1), Rank(2)];
        let same = vec![all_reduce(4, DType::F32, ReduceOp::Sum); 3];
        for me in 0..3 {
            agree(&same, &cx(&m, me)).unwrap();
        }
        let mut v = same.clone();
        v[2].count = 5;
        for me in 0..3 {
            match agree(&v, &cx(&m, me)).unwrap_err() {
                Error::Mismatch {
                    peer, expected, got, ..
                } => {
                    if me == 2 {
                        assert_eq!(peer, Rank(0));
                        assert_eq!(expected.bytes, 20);
                    } else {
                        assert_eq!(peer, Rank(2));
                        assert_eq!(got.bytes, 20);
                    }
                }
                e => panic!("{e}"),
            }
        }
        let mut v = same.clone();
        v[1].op = Some(ReduceOp::Max);
        let e = agree(&v, &cx(&m, 0)).unwrap_err().to_string();
        assert!(e.contains("reduce op") && e.contains("rank 1: max"), "{e}");
        assert_eq!(e, agree(&v, &cx(&m, 2)).unwrap_err().to_string());
        let mut v = same.clone();
        v[0].dtype = Some(DType::F64);
        assert!(matches!(
            agree(&v, &cx(&m, 1)).unwrap_err(),
            Error::Mismatch { .. }
        ));
        let mut v = same.clone();
        v[1].kind = Kind::Broadcast;
        assert!(
            agree(&v, &cx(&m, 0))
                .unwrap_err()
                .to_string()
                .contains("operation")
        );
        let mut v = same.clone();
        v[2].abstain = true;
        assert!(
            agree(&v, &cx(&m, 0))
                .unwrap_err()
                .to_string()
                .contains("rejected")
        );
        let mut v = same.clone();
        v[2].algo = Algo::Ring;
        assert!(
            agree(&v, &cx(&m, 0))
                .unwrap_err()
                .to_string()
                .contains("algorithm")
        );
        let mut v = same;
        v[1].seq = 8;
        assert!(agree(&v, &cx(&m, 0)).is_err());
    }

    #[test]
    fn splits_and_roots() {
        let m = [Rank(0), Rank(1)];
        let mk = |a: Vec<u64>, b: Vec<u64>| {
            let mut d = base(Kind::AllToAllSingle, 2);
            d.dtype = Some(DType::I32);
            d.a = a;
            d.b = b;
            d
        };
        // rank 0 sends [1, 2], rank 1 sends [3, 4]; rank 0 expects [1, 3], rank 1 [2, 4].
        let ok = vec![mk(vec![1, 2], vec![1, 3]), mk(vec![3, 4], vec![2, 4])];
        agree(&ok, &cx(&m, 0)).unwrap();
        let bad = vec![mk(vec![1, 2], vec![1, 3]), mk(vec![3, 4], vec![5, 4])];
        let e = agree(&bad, &cx(&m, 1)).unwrap_err().to_string();
        assert!(e.contains("split sizes"), "{e}");

        let mut b0 = base(Kind::Broadcast, 2);
        b0.root = Some(Rank(0));
        b0.dtype = Some(DType::U8);
        let mut b1 = b0.clone();
        b1.root = Some(Rank(1));
        assert!(
            agree(&[b0, b1], &cx(&m, 0))
                .unwrap_err()
                .to_string()
                .contains("root")
        );

        let mut g = base(Kind::Gather, 2);
        g.root = Some(Rank(0));
        g.dtype = Some(DType::U8);
        g.count = 3;
        g.a = vec![3, 4];
        let mut g1 = g.clone();
        g1.a = vec![0, 0];
        g1.count = 5;
        let e = agree(&[g, g1], &cx(&m, 1)).unwrap_err().to_string();
        assert!(e.contains("expects 4 from rank 1, which sends 5"), "{e}");
    }

    #[test]
    fn eager_payloads() {
        let m = [Rank(4), Rank(5), Rank(6)];
        let mut d = base(Kind::Reduce, 3);
        d.dtype = Some(DType::F32);
        d.count = 10;
        d.root = Some(Rank(5));
        d.eager = true;
        assert_eq!(eager_payload(&d, 0, 1, &m), Some((DType::F32, 10)));
        assert_eq!(eager_payload(&d, 0, 2, &m), None);
        assert_eq!(eager_payload(&d, 1, 0, &m), None);
        d.eager = false;
        assert_eq!(eager_payload(&d, 0, 1, &m), None);
        let mut s = base(Kind::ScatterObject, 3);
        s.root = Some(Rank(4));
        s.eager = true;
        s.a = vec![0, 7, 9];
        assert_eq!(eager_payload(&s, 0, 2, &m), Some((DType::U8, 9)));
        assert_eq!(eager_payload(&s, 1, 2, &m), None);
    }

    #[test]
    fn rank_hash_distinguishes_lists() {
        assert_ne!(hash_ranks(&[Rank(0), Rank(1)]), hash_ranks(&[Rank(0), Rank(2)]));
        assert_ne!(hash_ranks(&[Rank(0)]), hash_ranks(&[Rank(0), Rank(0)]));
        assert_eq!(hash_ranks(&[Rank(3), Rank(9)]), hash_ranks(&[Rank(3), Rank(9)]));
    }
}
