//! Fake-clock tests of the table: time is whatever `Instant` the test passes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

const C1: ClientId = ClientId(1);
const C2: ClientId = ClientId(2);

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn table() -> WorldTable<u32> {
    WorldTable::new("w", Limits::default())
}

fn small(limits: impl FnOnce(&mut Limits)) -> WorldTable<u32> {
    let mut l = Limits::default();
    limits(&mut l);
    WorldTable::new("w", l)
}

fn tokens(done: &[Completion<u32>]) -> Vec<u32> {
    let mut t: Vec<u32> = done.iter().map(|c| c.token).collect();
    t.sort();
    t
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[test]
fn set_then_try_get() {
    let mut t = table();
    assert_eq!(t.try_get(b"k").unwrap(), None);
    assert!(t.set(b("k"), b("v")).unwrap().is_empty());
    assert_eq!(t.try_get(b"k").unwrap(), Some(b("v")));
    t.set(b("k"), b("longer")).unwrap();
    assert_eq!(t.try_get(b"k").unwrap(), Some(b("longer")));
    assert_eq!(
        t.stats(),
        TableStats {
            keys: 1,
            bytes: 7,
            waiters: 0
        }
    );
}

#[test]
fn wait_ready_returns_values_in_key_order() {
    let mut t = table();
    t.multi_set(vec![(b("a"), b("1")), (b("b"), b("2"))]).unwrap();
    let now = Instant::now();
    match t.wait(C1, vec![b("b"), b("a")], true, now, secs(1), 7).unwrap() {
        WaitPoll::Ready(v, tok) => {
            assert_eq!(v, vec![b("2"), b("1")]);
            assert_eq!(tok, 7);
        }
        WaitPoll::Pending(_) => panic!("keys were present"),
    }
    assert_eq!(t.stats().waiters, 0);
}

#[test]
fn set_wakes_the_waiter_only_when_all_keys_exist() {
    let mut t = table();
    let now = Instant::now();
    let WaitPoll::Pending(_) = t.wait(C1, vec![b("a"), b("b")], true, now, secs(5), 1).unwrap() else {
        panic!("nothing set yet")
    };
    assert!(t.set(b("a"), b("x")).unwrap().is_empty());
    let done = t.set(b("b"), b("y")).unwrap();
    assert_eq!(tokens(&done), vec![1]);
    assert_eq!(done[0].result.as_ref().unwrap(), &vec![b("x"), b("y")]);
    assert_eq!(t.stats().waiters, 0);
    assert_eq!(t.next_deadline(), None);
}

#[test]
fn one_set_wakes_many_waiters() {
    let mut t = table();
    let now = Instant::now();
    for i in 0..256 {
        let client = ClientId(i as u64);
        assert!(matches!(
            t.wait(client, vec![b("go")], false, now, secs(5), i).unwrap(),
            WaitPoll::Pending(_)
        ));
    }
    let done = t.set(b("go"), b("1")).unwrap();
    assert_eq!(tokens(&done), (0..256).collect::<Vec<_>>());
    assert!(done.iter().all(|c| c.result.as_ref().unwrap().is_empty()));
    assert_eq!(t.stats().waiters, 0);
}

#[test]
fn a_key_deleted_before_the_last_key_arrives_keeps_the_wait_pending() {
    let mut t = table();
    let now = Instant::now();
    t.wait(C1, vec![b("a"), b("b")], false, now, secs(5), 1).unwrap();
    t.set(b("a"), b("1")).unwrap();
    assert!(t.delete(b"a").unwrap());
    assert!(t.set(b("b"), b("2")).unwrap().is_empty(), "a is missing again");
    let done = t.set(b("a"), b("3")).unwrap();
    assert_eq!(tokens(&done), vec![1]);
}

#[test]
fn timeouts_fire_exactly_at_the_deadline_in_order() {
    let mut t = table();
    let t0 = Instant::now();
    t.wait(C1, vec![b("k")], true, t0, Duration::from_millis(100), 1)
        .unwrap();
    t.wait(C1, vec![b("k")], true, t0, Duration::from_millis(50), 2)
        .unwrap();
    assert_eq!(t.next_deadline(), Some(t0 + Duration::from_millis(50)));
    assert!(t.expire(t0 + Duration::from_millis(49)).is_empty());
    let done = t.expire(t0 + Duration::from_millis(50));
    assert_eq!(tokens(&done), vec![2]);
    match &done[0].result {
        Err(StoreError::Timeout { what, after }) => {
            assert!(what.contains("\"k\""), "{what}");
            assert_eq!(*after, Duration::from_millis(50));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(t.stats().waiters, 1);
    let done = t.expire(t0 + secs(10));
    assert_eq!(tokens(&done), vec![1]);
    assert_eq!(t.stats().waiters, 0);
    // A set after the timeout wakes nobody.
    assert!(t.set(b("k"), b("v")).unwrap().is_empty());
}

#[test]
fn cancel_removes_every_trace_of_a_waiter() {
    let mut t = table();
    let now = Instant::now();
    let WaitPoll::Pending(id) = t.wait(C1, vec![b("a"), b("b")], true, now, secs(5), 9).unwrap() else {
        panic!()
    };
    assert_eq!(t.cancel(id), Some(9));
    assert_eq!(t.cancel(id), None);
    assert_eq!(t.stats().waiters, 0);
    assert_eq!(t.next_deadline(), None);
    assert!(t.watch.is_empty());
    assert!(t.per_client.is_empty());
    assert!(t.set(b("a"), b("1")).unwrap().is_empty());
    assert!(t.set(b("b"), b("1")).unwrap().is_empty());
}

#[test]
fn waiters_per_client_are_bounded_and_released() {
    let mut t = small(|l| l.max_waiters_per_client = 2);
    let now = Instant::now();
    let WaitPoll::Pending(first) = t.wait(C1, vec![b("k")], false, now, secs(5), 1).unwrap() else {
        panic!()
    };
    t.wait(C1, vec![b("k")], false, now, secs(5), 2).unwrap();
    let err = t.wait(C1, vec![b("k")], false, now, secs(5), 3).unwrap_err();
    assert!(matches!(
        err,
        StoreError::LimitExceeded {
            limit: Limit::WaitersPerClient,
            max: 2,
            requested: 3
        }
    ));
    // Another client is not affected; a cancelled wait frees a slot.
    t.wait(C2, vec![b("k")], false, now, secs(5), 4).unwrap();
    t.cancel(first);
    t.wait(C1, vec![b("k")], false, now, secs(5), 5).unwrap();
    // An already satisfied wait never counts.
    t.set(b("k"), b("v")).unwrap();
    for i in 0..10 {
        assert!(matches!(
            t.wait(C1, vec![b("k")], false, now, secs(5), i).unwrap(),
            WaitPoll::Ready(..)
        ));
    }
}

#[test]
fn add_counts_and_wakes() {
    let mut t = table();
    let now = Instant::now();
    t.wait(C1, vec![b("n")], true, now, secs(5), 1).unwrap();
    let (v, done) = t.add(b("n"), 5).unwrap();
    assert_eq!(v, 5);
    assert_eq!(done[0].result.as_ref().unwrap(), &vec![b("5")]);
    assert_eq!(t.add(b("n"), -7).unwrap().0, -2);
    assert_eq!(t.try_get(b"n").unwrap(), Some(b("-2")));
    assert_eq!(t.add(b("n"), 0).unwrap().0, -2);
}

#[test]
fn add_refuses_non_integers_and_overflow() {
    let mut t = table();
    t.set(b("s"), b("hello")).unwrap();
    assert!(matches!(
        t.add(b("s"), 1),
        Err(StoreError::InvalidArgument(m)) if m.contains("integer")
    ));
    t.add(b("big"), i64::MAX).unwrap();
    assert!(matches!(t.add(b("big"), 1), Err(StoreError::InvalidArgument(m)) if m.contains("overflow")));
    assert_eq!(
        t.try_get(b"big").unwrap(),
        Some(Bytes::from(i64::MAX.to_string()))
    );
}

#[test]
fn compare_and_set_edge_cases() {
    let mut t = table();
    // Missing key, expected "absent": swaps.
    let (o, _) = t.compare_and_set(b("k"), None, b("1")).unwrap();
    assert_eq!(
        o,
        CasOutcome {
            swapped: true,
            current: Some(b("1"))
        }
    );
    // Present key, expected "absent": no swap, reports the current value.
    let (o, _) = t.compare_and_set(b("k"), None, b("2")).unwrap();
    assert_eq!(
        o,
        CasOutcome {
            swapped: false,
            current: Some(b("1"))
        }
    );
    // Wrong expected value: no swap.
    let (o, _) = t.compare_and_set(b("k"), Some(b"0"), b("2")).unwrap();
    assert!(!o.swapped);
    // Right expected value: swaps.
    let (o, _) = t.compare_and_set(b("k"), Some(b"1"), b("2")).unwrap();
    assert!(o.swapped);
    assert_eq!(t.try_get(b"k").unwrap(), Some(b("2")));
    // Missing key, expected a value (even empty): no swap, nothing created.
    let (o, _) = t.compare_and_set(b("m"), Some(b""), b("x")).unwrap();
    assert_eq!(
        o,
        CasOutcome {
            swapped: false,
            current: None
        }
    );
    assert_eq!(t.try_get(b"m").unwrap(), None);
    // Present empty value matches an empty expected value.
    t.set(b("e"), Bytes::new()).unwrap();
    assert!(t.compare_and_set(b("e"), Some(b""), b("y")).unwrap().0.swapped);
}

#[test]
fn compare_and_set_wakes_waiters_only_when_it_swaps() {
    let mut t = table();
    let now = Instant::now();
    t.wait(C1, vec![b("k")], true, now, secs(5), 1).unwrap();
    let (_, done) = t.compare_and_set(b("k"), Some(b"x"), b("1")).unwrap();
    assert!(done.is_empty());
    let (_, done) = t.compare_and_set(b("k"), None, b("1")).unwrap();
    assert_eq!(tokens(&done), vec![1]);
}

#[test]
fn append_creates_and_extends() {
    let mut t = table();
    assert_eq!(t.append(b("log"), b"ab").unwrap().0, 2);
    assert_eq!(t.append(b("log"), b"cd").unwrap().0, 4);
    assert_eq!(t.try_get(b"log").unwrap(), Some(b("abcd")));
    assert_eq!(t.stats().bytes, 3 + 4);
}

#[test]
fn check_delete_and_num_keys() {
    let mut t = table();
    t.set(b("a"), b("1")).unwrap();
    assert!(t.check(&[b("a")]).unwrap());
    assert!(!t.check(&[b("a"), b("b")]).unwrap());
    assert_eq!(t.num_keys().unwrap(), 1);
    assert!(t.delete(b"a").unwrap());
    assert!(!t.delete(b"a").unwrap());
    assert_eq!(t.num_keys().unwrap(), 0);
    assert_eq!(t.stats().bytes, 0);
}

#[test]
fn bounds_are_checked_before_storing() {
    let mut t = small(|l| {
        l.max_key_len = 4;
        l.max_value_len = 8;
        l.max_keys = 2;
        l.max_total_bytes = 20;
        l.max_keys_per_request = 3;
    });
    let lim = |r: Result<Vec<Completion<u32>>, StoreError>| match r {
        Err(StoreError::LimitExceeded { limit, .. }) => limit,
        other => panic!("{other:?}"),
    };
    assert_eq!(lim(t.set(b("12345"), b("v"))), Limit::KeyLen);
    assert_eq!(lim(t.set(b("k"), b("123456789"))), Limit::ValueLen);
    t.set(b("a"), b("12345678")).unwrap();
    t.set(b("b"), b("12345678")).unwrap();
    assert_eq!(lim(t.set(b("c"), b("1"))), Limit::Keys);
    // Replacing a key's value within the totals is fine.
    t.set(b("b"), b("1")).unwrap();
    t.set(b("c"), b("1234")).unwrap_err();
    assert!(matches!(
        t.set(Bytes::new(), b("v")),
        Err(StoreError::InvalidArgument(_))
    ));
    assert_eq!(lim(t.multi_set(vec![(b("a"), b("1")); 4])), Limit::KeysPerRequest);
    // A failed batch leaves nothing behind.
    let before = t.stats();
    assert_eq!(
        lim(t.multi_set(vec![(b("a"), b("1")), (b("x"), b("2")), (b("y"), b("3"))])),
        Limit::Keys
    );
    assert_eq!(t.stats(), before);
    assert_eq!(t.try_get(b"a").unwrap(), Some(b("12345678")));
    // Append beyond the value bound is refused.
    assert!(matches!(
        t.append(b("a"), b"x"),
        Err(StoreError::LimitExceeded {
            limit: Limit::ValueLen,
            ..
        })
    ));
}

#[test]
fn total_bytes_bound_counts_replacements() {
    let mut t = small(|l| l.max_total_bytes = 10);
    t.set(b("a"), b("123456789")).unwrap();
    // Replacing frees the old value first.
    t.set(b("a"), b("987654321")).unwrap();
    assert!(matches!(
        t.set(b("b"), b("1")),
        Err(StoreError::LimitExceeded {
            limit: Limit::TotalBytes,
            ..
        })
    ));
    // Within a batch, a later duplicate replaces the earlier one.
    t.multi_set(vec![(b("a"), b("1")), (b("a"), b("2")), (b("b"), b("3"))])
        .unwrap();
    assert_eq!(t.stats().bytes, 4);
}

#[test]
fn close_fails_every_waiter_frees_data_and_refuses_later_calls() {
    let mut t = table();
    let now = Instant::now();
    t.set(b("a"), b("1")).unwrap();
    for i in 0..5 {
        t.wait(ClientId(i as u64), vec![b("never")], true, now, secs(5), i)
            .unwrap();
    }
    let done = t.close();
    assert_eq!(tokens(&done), vec![0, 1, 2, 3, 4]);
    assert!(
        done.iter()
            .all(|c| matches!(&c.result, Err(StoreError::Closed { world }) if world == "w"))
    );
    assert_eq!(t.stats(), TableStats::default());
    assert!(t.is_closed());
    assert!(matches!(t.set(b("a"), b("1")), Err(StoreError::Closed { .. })));
    assert!(matches!(t.try_get(b"a"), Err(StoreError::Closed { .. })));
    assert!(matches!(
        t.wait(C1, vec![b("a")], true, now, secs(1), 0),
        Err(StoreError::Closed { .. })
    ));
    assert!(t.expire(now + secs(100)).is_empty());
}

#[test]
fn a_waiter_naming_a_key_twice_is_woken_once() {
    let mut t = table();
    let now = Instant::now();
    t.wait(C1, vec![b("k"), b("k")], true, now, secs(5), 1).unwrap();
    let done = t.set(b("k"), b("v")).unwrap();
    assert_eq!(tokens(&done), vec![1]);
    assert_eq!(done[0].result.as_ref().unwrap(), &vec![b("v"), b("v")]);
    assert_eq!(t.stats().waiters, 0);
}

#[test]
fn huge_timeouts_do_not_overflow() {
    let mut t = table();
    let now = Instant::now();
    t.wait(C1, vec![b("k")], true, now, Duration::MAX, 1).unwrap();
    assert!(t.expire(now + secs(86_400)).is_empty());
}

#[test]
fn a_multi_get_naming_one_big_key_many_times_is_refused_before_the_reply_is_built() {
    let mut t = small(|l| l.max_reply_bytes = 4 << 20);
    t.set(b("big"), Bytes::from(vec![0u8; 1 << 20])).unwrap();
    let now = Instant::now();
    // Ready at once: 16 × 1 MiB is over the bound.
    let err = t.wait(C1, vec![b("big"); 16], true, now, secs(1), 1).unwrap_err();
    assert!(
        matches!(err, StoreError::LimitExceeded { limit: Limit::ReplyBytes, max, requested }
            if max == 4 << 20 && requested > 16 << 20),
        "{err}"
    );
    // Three copies fit.
    assert!(matches!(
        t.wait(C1, vec![b("big"); 3], true, now, secs(1), 2).unwrap(),
        WaitPoll::Ready(v, _) if v.len() == 3
    ));
    // A presence-only wait builds no reply and is not bounded by it.
    assert!(matches!(
        t.wait(C1, vec![b("big"); 16], false, now, secs(1), 3).unwrap(),
        WaitPoll::Ready(..)
    ));
    // Pending, then completed by a set: the completion carries the error.
    let mut keys = vec![b("big"); 8];
    keys.push(b("late"));
    assert!(matches!(
        t.wait(C1, keys, true, now, secs(1), 4).unwrap(),
        WaitPoll::Pending(_)
    ));
    let done = t.set(b("late"), b("x")).unwrap();
    assert_eq!(tokens(&done), vec![4]);
    assert!(matches!(
        done[0].result,
        Err(StoreError::LimitExceeded {
            limit: Limit::ReplyBytes,
            ..
        })
    ));
    assert_eq!(t.stats().waiters, 0);
}

#[test]
fn waiters_are_bounded_per_world_across_clients() {
    let mut t = small(|l| {
        l.max_waiters_per_client = 2;
        l.max_waiters_per_world = 5;
    });
    let now = Instant::now();
    let mut token = 0;
    for c in 0..3 {
        for _ in 0..2 {
            token += 1;
            let r = t.wait(ClientId(c), vec![b("k")], false, now, secs(1), token);
            if token <= 5 {
                assert!(matches!(r.unwrap(), WaitPoll::Pending(_)));
            } else {
                assert!(matches!(
                    r.unwrap_err(),
                    StoreError::LimitExceeded {
                        limit: Limit::WaitersPerWorld,
                        max: 5,
                        requested: 6
                    }
                ));
            }
        }
    }
    assert_eq!(t.set(b("k"), b("v")).unwrap().len(), 5);
    // Released places can be taken again.
    assert!(matches!(
        t.wait(ClientId(9), vec![b("other")], false, now, secs(1), 99)
            .unwrap(),
        WaitPoll::Pending(_)
    ));
}

#[test]
fn releasing_many_waiters_on_one_key_is_linear() {
    // 40,000 waiters on one key (40 clients × 1,000), as the measured attack
    // parked. With a scan of the key's watch list per removal this was
    // quadratic (1.6e9 steps); with per-key sets it is a few milliseconds.
    let mut t = small(|l| l.max_waiters_per_world = 40_000);
    let now = Instant::now();
    for i in 0..40_000u32 {
        let keys = vec![b("go"), b(&format!("own{}", i % 7))];
        t.wait(ClientId(u64::from(i / 1000)), keys, false, now, secs(60), i)
            .unwrap();
    }
    for k in 0..7 {
        t.set(b(&format!("own{k}")), b("1")).unwrap();
    }
    let started = std::time::Instant::now();
    let done = t.set(b("go"), b("1")).unwrap();
    let took = started.elapsed();
    assert_eq!(done.len(), 40_000);
    assert_eq!(t.stats().waiters, 0);
    assert!(t.watch.is_empty() && t.per_client.is_empty() && t.deadlines.is_empty());
    // Generous for a debug build on a loaded 2-core machine; the quadratic
    // version took minutes here.
    assert!(
        took < Duration::from_secs(3),
        "releasing 40,000 waiters took {took:?}"
    );
}
