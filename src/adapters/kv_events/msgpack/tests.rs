use super::*;
use rmpv::Value;

fn bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

#[test]
fn heads_of_every_kind() {
    let cases = [
        (Value::Nil, Head::Nil),
        (Value::from(true), Head::Bool(true)),
        (Value::from(7), Head::Int(Int::Pos(7))),
        (Value::from(-3), Head::Int(Int::Neg(-3))),
        (Value::from(u64::MAX), Head::Int(Int::Pos(u64::MAX))),
        (Value::from(i64::MIN), Head::Int(Int::Neg(i64::MIN))),
        (Value::F64(1.5), Head::F64(1.5)),
        (Value::F32(0.5), Head::F32(0.5)),
        (Value::from("ab"), Head::Str(b"ab")),
        (Value::Binary(vec![1, 2]), Head::Bin(&[1, 2])),
        (Value::Ext(3, vec![9]), Head::Ext),
    ];
    for (v, want) in cases {
        let raw = bytes(&v);
        let mut c = Cursor::new(&raw);
        assert_eq!(c.head(16).unwrap().0, want, "{v:?}");
        assert!(c.rest().is_empty(), "{v:?}");
    }
    // A signed marker holding a non-negative value is unsigned, as in rmpv.
    let mut c = Cursor::new(&[0xd0, 0x05]);
    assert_eq!(c.head(16).unwrap().0, Head::Int(Int::Pos(5)));
}

#[test]
fn u32s_reads_the_token_encodings_and_stops_at_anything_else() {
    // 7, 200 (uint 8), 40000 (uint 16), 3e9 (uint 32), then a uint 64 and a
    // negative fixint, which the general path reads.
    let raw = [
        0x07, 0xcc, 200, 0xcd, 0x9c, 0x40, 0xce, 0xb2, 0xd0, 0x5e, 0x00, 0xcf, 0, 0, 0, 0, 0, 0, 0,
        1, 0xff,
    ];
    let mut c = Cursor::new(&raw);
    let mut out = Vec::new();
    assert_eq!(c.u32s(6, &mut out), 4);
    assert_eq!(out, [7, 200, 40_000, 3_000_000_000]);
    assert_eq!(c.uint(16).unwrap(), Some(1));
    assert_eq!(c.u32s(1, &mut out), 0);
    assert_eq!(c.head(16).unwrap().0, Head::Int(Int::Neg(-1)));
    // It reads no more than asked, and a cut item is left for the general path.
    let mut c = Cursor::new(&[0x01, 0x02, 0xcd, 0x01]);
    assert_eq!(c.u32s(1, &mut out), 1);
    assert_eq!(c.u32s(5, &mut out), 1);
    assert_eq!(c.rest(), [0xcd, 0x01]);
}

/// Items one at a time: how many leading items the fast readers take.
/// `u64`: uint 64 is one of the encodings (hashes), else not (token ids).
fn leading<T>(raw: &[u8], n: u32, u64: bool, one: impl Fn(Head<'_>) -> Option<T>) -> Vec<T> {
    let mut c = Cursor::new(raw);
    let mut out = Vec::new();
    for _ in 0..n {
        let before = c;
        // A token/hash item is one byte of marker plus its value: anything
        // longer or shorter than these encodings is for the general path.
        let Ok(head) = c.item(16) else { break };
        let used = before.rest().len() - c.rest().len();
        let marker = before.rest()[0];
        let fast = match marker {
            0x00..=0x7f => used == 1,
            0xcc => used == 2,
            0xcd => used == 3,
            0xce => used == 5,
            0xcf => u64 && used == 9,
            _ => false,
        };
        match one(head) {
            Some(v) if fast => out.push(v),
            _ => break,
        }
    }
    out
}

#[test]
fn u32s_and_u64s_read_runs_of_any_width_as_item_by_item() {
    // Runs of one width, alternations, values at each width's edges, cut items
    // and other kinds; every prefix of each sequence.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let edges = [
        0u64,
        127,
        128,
        255,
        256,
        65_535,
        65_536,
        u64::from(u32::MAX),
        u64::from(u32::MAX) + 1,
        u64::MAX,
    ];
    for case in 0..400 {
        let len = (next() % 40) as usize;
        let mut items = Vec::new();
        let mut width = next() % 5;
        for _ in 0..len {
            if next() % 6 == 0 {
                width = next() % 5;
            }
            let v = match width {
                0 => next() % 128,
                1 => 128 + next() % 128,
                2 => 256 + next() % 65_280,
                3 => 65_536 + next() % (u64::from(u32::MAX) - 65_535),
                _ => edges[(next() % edges.len() as u64) as usize],
            };
            items.push(match next() % 50 {
                0 => Value::from(-1),
                1 => Value::from("x"),
                2 => Value::Binary(vec![1, 2]),
                _ => Value::from(v),
            });
        }
        let mut raw = Vec::new();
        for v in &items {
            raw.extend(bytes(v));
        }
        for cut in [raw.len(), raw.len().saturating_sub(1), raw.len() / 2] {
            let raw = &raw[..cut];
            for n in [len as u32, (len / 2) as u32, len as u32 + 3] {
                let want32 = leading(raw, n, false, |h| match h {
                    Head::Int(Int::Pos(v)) => u32::try_from(v).ok(),
                    _ => None,
                });
                let mut c = Cursor::new(raw);
                let mut got = vec![7];
                assert_eq!(c.u32s(n, &mut got) as usize, want32.len(), "case {case}");
                assert_eq!(got[0], 7, "what was in the output stays");
                assert_eq!(&got[1..], want32, "case {case}");
                let used: usize = {
                    let mut d = Cursor::new(raw);
                    for _ in 0..want32.len() {
                        d.item(16).unwrap();
                    }
                    raw.len() - d.rest().len()
                };
                assert_eq!(c.rest(), &raw[used..], "case {case}");

                let want64 = leading(raw, n, true, |h| match h {
                    Head::Int(Int::Pos(v)) => Some(v),
                    _ => None,
                });
                let mut c = Cursor::new(raw);
                let mut got = Vec::new();
                assert_eq!(c.u64s(n, &mut got) as usize, want64.len(), "case {case}");
                assert_eq!(got, want64, "case {case}");
            }
        }
    }
}

#[test]
fn skip_returns_the_bytes_of_one_value() {
    let v = Value::Array(vec![
        Value::from(1),
        Value::Map(vec![(Value::from("k"), Value::Array(vec![]))]),
        Value::from("x"),
    ]);
    let mut raw = bytes(&v);
    raw.push(0xc0);
    let mut c = Cursor::new(&raw);
    assert_eq!(c.value(16).unwrap(), &raw[..raw.len() - 1]);
    assert_eq!(c.rest(), &[0xc0]);
}

#[test]
fn depth_is_counted_as_rmpv_counts_it() {
    // The deepest nest of arrays around a string each accepts, and one more.
    for leaf in [Value::from("s"), Value::from(1), Value::Binary(vec![1])] {
        for nest in 0..12 {
            let mut v = leaf.clone();
            for _ in 0..nest {
                v = Value::Array(vec![v]);
            }
            let raw = bytes(&v);
            let ours = Cursor::new(&raw).skip(16).is_ok();
            let theirs = rmpv::decode::read_value_with_max_depth(&mut &raw[..], 16).is_ok();
            assert_eq!(ours, theirs, "{nest} arrays around {leaf:?}");
        }
    }
}

#[test]
fn truncated_is_malformed_and_the_reserved_marker_is_nil() {
    let raw = bytes(&Value::Array(vec![
        Value::from("abc"),
        Value::from(1u64 << 40),
    ]));
    for cut in 0..raw.len() {
        assert!(Cursor::new(&raw[..cut]).skip(16).is_err(), "cut {cut}");
    }
    assert_eq!(Cursor::new(&[0xc1]).head(16).unwrap().0, Head::Nil);
    // A length far beyond the bytes allocates nothing and fails.
    assert!(
        Cursor::new(&[0xdd, 0xff, 0xff, 0xff, 0xff])
            .skip(16)
            .is_err()
    );
}
