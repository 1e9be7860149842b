use super::*;

#[test]
fn entry_stays_small() {
    assert_eq!(std::mem::size_of::<Holders>(), 8);
    assert_eq!(std::mem::size_of::<Entry>(), 20);
    assert_eq!(std::mem::align_of::<Entry>(), 4);
    for v in [
        0,
        1,
        u64::from(u32::MAX),
        1 << 32,
        u64::MAX,
        0x0123_4567_89ab_cdef,
    ] {
        assert_eq!(Halves::new(v).get(), v);
    }
}

#[test]
fn a_list_mask_is_given_only_while_it_covers_every_holder() {
    let mut lists = HolderLists::default();
    let mut h = Holders::new(1);
    assert_eq!(lists.list_mask(h), None);
    h.add(&mut lists, 2);
    assert_eq!(lists.list_mask(h), Some(0b110));
    assert_eq!(h.with(&lists).low_mask(), Some(0b110));
    h.add(&mut lists, 70);
    assert_eq!(lists.list_mask(h), None);
    assert_eq!(h.with(&lists).low_mask(), None);
    h.add(&mut lists, tier_slot(3, Tier::Cpu));
    h.release(&mut lists, 70);
    assert_eq!(
        lists.list_mask(h),
        None,
        "a lower-tier holder is outside the mask"
    );
    h.remove_all(&mut lists, tier_slot(3, Tier::Cpu));
    assert_eq!(lists.list_mask(h), Some(0b110));
    assert_eq!(h.with(&lists).low_mask(), Some(0b110));
}

#[test]
fn references_are_counted_per_replica() {
    let mut lists = HolderLists::default();
    let mut h = Holders::new(1);
    assert!(!h.add(&mut lists, 1));
    assert!(h.add(&mut lists, 2));
    assert_eq!(h.with(&lists).len(), 2);
    assert_eq!(h.with(&lists).low_mask(), Some(0b110));
    assert!(h.add(&mut lists, 70));
    assert!(
        !h.add(&mut lists, 70),
        "a second reference, not a new holder"
    );
    assert_eq!(h.with(&lists).low_mask(), None);
    assert!(h.remove_all(&mut lists, 70));
    assert_eq!(h.release(&mut lists, 1), Release::StillHeld);
    assert_eq!(h.release(&mut lists, 1), Release::Released);
    assert!(!h.with(&lists).contains(1));
    assert_eq!(h.release(&mut lists, 1), Release::NotHeld);
    // Back inline, and the spilled list freed.
    assert_eq!(h, Holders(Holder { slot: 2, refs: 1 }));
    assert_eq!(lists.in_use(), 0);
    assert_eq!(h.with(&lists).low_mask(), Some(1 << 2));
    assert_eq!(h.release(&mut lists, 2), Release::Released);
    assert!(h.is_empty());
    assert_eq!(h.with(&lists).slots().count(), 0);
}

#[test]
fn remove_all_ignores_counts() {
    let mut lists = HolderLists::default();
    let mut h = Holders::new(3);
    h.add(&mut lists, 3);
    h.add(&mut lists, 4);
    assert!(h.remove_all(&mut lists, 3));
    assert!(!h.remove_all(&mut lists, 3));
    assert_eq!(h.with(&lists).slots().collect::<Vec<_>>(), vec![4]);
}

#[test]
fn taking_spilled_holders_frees_their_list() {
    let mut lists = HolderLists::default();
    let mut a = Holders::new(0);
    a.add(&mut lists, 1);
    a.add(&mut lists, 65);
    assert_eq!(a.take(&mut lists).as_slice(), &[0, 1, 65]);
    assert!(a.is_empty());
    assert_eq!(lists.in_use(), 0);
    // The freed list is reused by the next entry that spills.
    let mut b = Holders::new(5);
    b.add(&mut lists, 6);
    assert_eq!(lists.lists.len(), 1);
    assert_eq!(b.with(&lists).low_mask(), Some(1 << 5 | 1 << 6));
}

#[test]
fn credit_saturates() {
    let e = Entry::new(0, 0);
    e.accesses.store(u32::MAX, Ordering::Relaxed);
    e.credit();
    assert_eq!(e.accesses(), u32::MAX);
}
