//! Object collectives: broadcast, all-gather, gather and scatter of any
//! `serde`-serialisable value, like torch's `*_object` / `*_object_list`
//! functions. Values are encoded with `postcard` (compact, maintained, `no_std`
//! friendly) and travel as `u8` messages. Each encoded value's length is part of
//! the call descriptor, so every receiver knows the exact size before allocating,
//! and lengths above [`CollectiveConfig::max_object_bytes`] (the same on every
//! member) are refused on every member before any of the object is sent. Decoding can still allocate more than the encoded
//! size for some types (serde grows collections as elements decode); peers are
//! authenticated members of the world, so this bounds mistakes, not attacks.
//!
//! [`CollectiveConfig::max_object_bytes`]: crate::CollectiveConfig::max_object_bytes

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::algo::to_peers;
use crate::desc::Kind;
use crate::group::{Ctx, Group, Ticket, finish_sends};
use crate::handle::CollectiveHandle;
use crate::util::{try_join_all, try_join2};
use multiworld_tcp::{Error, Result};
use multiworld_types::Rank;
use multiworld_types::{DType, Tensor, TensorView};

fn encode<T: Serialize>(kind: Kind, v: &T, max: usize) -> Result<Vec<u8>> {
    let b = postcard::to_allocvec(v)
        .map_err(|e| Error::invalid(format!("{}: could not serialise the object: {e}", kind.name())))?;
    if b.len() > max {
        return Err(Error::invalid(format!(
            "{}: the object is {} bytes serialised, above max_object_bytes ({max})",
            kind.name(),
            b.len()
        )));
    }
    Ok(b)
}

fn decode<T: DeserializeOwned>(kind: Kind, b: &[u8], from: Rank) -> Result<T> {
    postcard::from_bytes(b).map_err(|e| {
        Error::invalid(format!(
            "{}: could not decode the object from rank {from}: {e}",
            kind.name()
        ))
    })
}

fn invalid_in(kind: Kind, msg: &str) -> Error {
    Error::invalid(format!("{}: {msg}", kind.name()))
}

/// Receives `len` bytes from member `p`.
async fn recv_bytes(cx: Ctx<'_>, p: usize, len: u64) -> Result<Tensor> {
    let len = usize::try_from(len).map_err(|_| Error::invalid("object length overflows usize"))?;
    cx.recv_new(p, Tensor::zeros(DType::U8, [len])?).await
}

impl Group {
    /// Sends `root`'s value to every member and returns it everywhere (the root
    /// gets its own value back, decoded from the same bytes). `value` must be
    /// `Some` on the root and is ignored elsewhere.
    pub async fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: Option<&T>,
        root: Rank,
    ) -> Result<T> {
        self.broadcast_object_in(self.ticket(), value, root).await
    }

    /// Handle form of [`Group::broadcast_object`].
    pub fn broadcast_object_handle<T>(&self, value: Option<T>, root: Rank) -> CollectiveHandle<T>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move { g.broadcast_object_in(ticket, value.as_ref(), root).await })
    }

    async fn broadcast_object_in<T: Serialize + DeserializeOwned>(
        &self,
        ticket: Ticket,
        value: Option<&T>,
        root: Rank,
    ) -> Result<T> {
        let kind = Kind::BroadcastObject;
        let call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let mut d = call.desc();
        d.root = Some(root);
        let valid = self.root_index(root).and_then(|r| {
            if r != cx.me {
                return Ok((r, None));
            }
            let v = value.ok_or_else(|| invalid_in(kind, "the root must pass a value"))?;
            Ok((r, Some(encode(kind, v, self.config().max_object_bytes)?)))
        });
        let (root_i, bytes) = match valid {
            Ok(v) => v,
            Err(e) => return Err(call.abstain(e).await),
        };
        let len = bytes.as_ref().map_or(0, Vec::len) as u64;
        d.count = len;
        call.plan(&mut d, 0, len * (cx.n() as u64 - 1));
        call.guard(async {
            let payloads = match &bytes {
                Some(b) => to_peers(cx, TensorView::from(b)),
                None => Vec::new(),
            };
            let (descs, sends) = cx.exchange(&d, &payloads).await?;
            let out = match &bytes {
                Some(b) => {
                    if !d.eager {
                        cx.send_all(&payloads).await?;
                    }
                    decode(kind, b, root)?
                }
                None => {
                    let t = recv_bytes(cx, root_i, descs[root_i].count).await?;
                    decode(kind, t.as_slice::<u8>()?, root)?
                }
            };
            finish_sends(sends).await?;
            Ok(out)
        })
        .await
    }

    /// Gathers every member's value; every member gets them all, in
    /// [`Group::ranks`] order.
    pub async fn all_gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        self.gather_object_in(self.ticket(), value, None)
            .await
            .map(Option::unwrap_or_default)
    }

    /// Handle form of [`Group::all_gather_object`].
    pub fn all_gather_object_handle<T>(&self, value: T) -> CollectiveHandle<Vec<T>>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move {
            g.gather_object_in(ticket, &value, None)
                .await
                .map(Option::unwrap_or_default)
        })
    }

    /// Gathers every member's value at `root` (`Some(values)` in [`Group::ranks`]
    /// order there, `None` elsewhere).
    pub async fn gather_object<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
        root: Rank,
    ) -> Result<Option<Vec<T>>> {
        self.gather_object_in(self.ticket(), value, Some(root)).await
    }

    /// Handle form of [`Group::gather_object`].
    pub fn gather_object_handle<T>(&self, value: T, root: Rank) -> CollectiveHandle<Option<Vec<T>>>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move { g.gather_object_in(ticket, &value, Some(root)).await })
    }

    /// Gather (`root: Some`) or all-gather (`None`; the result is then always
    /// `Some`).
    async fn gather_object_in<T: Serialize + DeserializeOwned>(
        &self,
        ticket: Ticket,
        value: &T,
        root: Option<Rank>,
    ) -> Result<Option<Vec<T>>> {
        let kind = if root.is_some() {
            Kind::GatherObject
        } else {
            Kind::AllGatherObject
        };
        let call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let mut d = call.desc();
        d.root = root;
        let valid = root
            .map(|r| self.root_index(r))
            .transpose()
            .and_then(|r| Ok((r, encode(kind, value, self.config().max_object_bytes)?)));
        let (root_i, bytes) = match valid {
            Ok(v) => v,
            Err(e) => return Err(call.abstain(e).await),
        };
        d.count = bytes.len() as u64;
        // Who sends to whom: all-gather everyone to everyone; gather to the root.
        let targets: Vec<usize> = match root_i {
            None => cx.peers().collect(),
            Some(r) if r == cx.me => Vec::new(),
            Some(r) => vec![r],
        };
        let receives = root_i.is_none_or(|r| r == cx.me);
        call.plan(&mut d, 0, (bytes.len() * targets.len()) as u64);
        call.guard(async {
            let payloads: Vec<_> = targets.iter().map(|&q| (q, TensorView::from(&bytes))).collect();
            let (descs, sends) = cx.exchange(&d, &payloads).await?;
            let sending = async {
                if d.eager {
                    Ok(())
                } else {
                    cx.send_all(&payloads).await
                }
            };
            let receiving = async {
                if !receives {
                    return Ok(Vec::new());
                }
                try_join_all(cx.peers().map(|p| {
                    let len = descs[p].count;
                    async move { Ok((p, recv_bytes(cx, p, len).await?)) }
                }))
                .await
            };
            let (_, got) = try_join2(sending, receiving).await?;
            finish_sends(sends).await?;
            if !receives {
                return Ok(None);
            }
            let mut out = Vec::with_capacity(n);
            for p in 0..n {
                let v = if p == cx.me {
                    decode(kind, &bytes, cx.members[p])?
                } else {
                    let t = got
                        .iter()
                        .find(|(q, _)| *q == p)
                        .map(|(_, t)| t)
                        .ok_or_else(|| Error::invalid("internal: missing object"))?;
                    decode(kind, t.as_slice::<u8>()?, cx.members[p])?
                };
                out.push(v);
            }
            Ok(Some(out))
        })
        .await
    }

    /// Sends `values[p]` of `root` to member p (in [`Group::ranks`] order) and
    /// returns each member's value. `values` must be `Some` on the root (one value
    /// per member) and is ignored elsewhere.
    pub async fn scatter_object<T: Serialize + DeserializeOwned>(
        &self,
        values: Option<&[T]>,
        root: Rank,
    ) -> Result<T> {
        self.scatter_object_in(self.ticket(), values, root).await
    }

    /// Handle form of [`Group::scatter_object`].
    pub fn scatter_object_handle<T>(&self, values: Option<Vec<T>>, root: Rank) -> CollectiveHandle<T>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        let (ticket, g) = (self.ticket(), self.clone());
        Group::spawn(async move { g.scatter_object_in(ticket, values.as_deref(), root).await })
    }

    async fn scatter_object_in<T: Serialize + DeserializeOwned>(
        &self,
        ticket: Ticket,
        values: Option<&[T]>,
        root: Rank,
    ) -> Result<T> {
        let kind = Kind::ScatterObject;
        let call = self.begin(ticket, kind).await?;
        let cx = call.ctx();
        let n = cx.n();
        let mut d = call.desc();
        d.root = Some(root);
        let valid = self.root_index(root).and_then(|r| {
            if r != cx.me {
                return Ok((r, Vec::new()));
            }
            let vs = values.ok_or_else(|| invalid_in(kind, "the root must pass a list of values"))?;
            if vs.len() != n {
                return Err(invalid_in(
                    kind,
                    &format!("the root passed {} values for a group of {n}", vs.len()),
                ));
            }
            let max = self.config().max_object_bytes;
            Ok((
                r,
                vs.iter()
                    .map(|v| encode(kind, v, max))
                    .collect::<Result<Vec<_>>>()?,
            ))
        });
        let (root_i, encoded) = match valid {
            Ok(v) => v,
            Err(e) => return Err(call.abstain(e).await),
        };
        let is_root = root_i == cx.me;
        let mut send_bytes = 0;
        for (q, b) in encoded.iter().enumerate() {
            d.a[q] = b.len() as u64;
            if q != cx.me {
                send_bytes += b.len() as u64;
            }
        }
        call.plan(&mut d, 0, send_bytes);
        call.guard(async {
            let payloads: Vec<_> = if is_root {
                cx.peers().map(|q| (q, TensorView::from(&encoded[q]))).collect()
            } else {
                Vec::new()
            };
            let (descs, sends) = cx.exchange(&d, &payloads).await?;
            let out = if is_root {
                if !d.eager {
                    cx.send_all(&payloads).await?;
                }
                decode(kind, &encoded[cx.me], root)?
            } else {
                let t = recv_bytes(cx, root_i, descs[root_i].a[cx.me]).await?;
                decode(kind, t.as_slice::<u8>()?, root)?
            };
            finish_sends(sends).await?;
            Ok(out)
        })
        .await
    }
}
