use super::*;

#[test]
fn plain_blocks_hash_as_the_general_encoding() {
    for n in 0..=70u32 {
        let t: Vec<u32> = (0..n).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        for parent in [None, Some(0), Some(u64::MAX), Some(0x0123_4567_89ab_cdef)] {
            assert_eq!(
                block_value(parent, &t, &[]),
                general_value(parent, &t, &[]),
                "{n} tokens, parent {parent:?}"
            );
        }
    }
}

#[test]
fn xxh3_is_the_reference_function() {
    // XXH3_64bits("", seed 0) and of "abc", from the xxHash reference.
    assert_eq!(xxh3_64(b""), 0x2d06_8005_38d3_94c2);
    assert_eq!(xxh3_64(b"abc"), 0x78af_5f94_892f_3950);
}

#[test]
fn an_empty_identity_is_no_identity() {
    assert_eq!(identity_digest("", ""), None);
    assert_eq!(identity_key(None, 42), 42);
    assert_ne!(identity_key(identity_digest("a", ""), 42), 42);
}

#[test]
fn adapter_and_salt_never_encode_alike() {
    // Moving bytes between the two fields, or swapping them, is another digest.
    let all = [
        identity_digest("ab", ""),
        identity_digest("a", "b"),
        identity_digest("", "ab"),
        identity_digest("b", "a"),
        Some(unnamed_adapter_digest(7, "")),
        Some(unnamed_adapter_digest(7, "s")),
        Some(unnamed_adapter_digest(8, "")),
    ];
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            assert_ne!(a, b);
        }
    }
}

#[test]
fn fields_never_run_into_each_other() {
    let t = [1u32, 2, 3, 4];
    let base = block_value(None, &t, &[]);
    // Parent 0 is not "no parent".
    assert_ne!(base, block_value(Some(0), &t, &[]));
    // A token moved into an extra key, or an identifier split differently.
    let a = block_value(
        None,
        &t,
        &[Extra::Mm {
            identifier: "ab",
            offset: 0,
        }],
    );
    let b = block_value(
        None,
        &t,
        &[
            Extra::Mm {
                identifier: "a",
                offset: 0,
            },
            Extra::Mm {
                identifier: "b",
                offset: 0,
            },
        ],
    );
    let c = block_value(
        None,
        &t,
        &[Extra::Mm {
            identifier: "ab",
            offset: 1,
        }],
    );
    let d = block_value(None, &t, &[Extra::Embeds(b"ab")]);
    let e = block_value(None, &t, &[Extra::Opaque(b"ab")]);
    let all = [base, a, b, c, d, e, block_value(None, &t[..3], &[])];
    for (i, x) in all.iter().enumerate() {
        for y in &all[i + 1..] {
            assert_ne!(x, y);
        }
    }
}

#[test]
fn mm_extras_follow_vllm() {
    // An image at prompt positions 10..30, blocks of 16: block 0 holds its
    // start (offset 10), block 1 its rest (offset -6), block 2 nothing.
    let mm = [MmInput {
        identifier: "img",
        offset: 10,
        length: 20,
    }];
    assert_eq!(
        mm_extras(&mm, 0, 16).as_slice(),
        &[Extra::Mm {
            identifier: "img",
            offset: 10
        }]
    );
    assert_eq!(
        mm_extras(&mm, 16, 32).as_slice(),
        &[Extra::Mm {
            identifier: "img",
            offset: -6
        }]
    );
    assert!(mm_extras(&mm, 32, 48).is_empty());
    // Ends exactly at a block boundary: not in the next block.
    let edge = [MmInput {
        identifier: "x",
        offset: 0,
        length: 16,
    }];
    assert!(mm_extras(&edge, 16, 32).is_empty());
}
