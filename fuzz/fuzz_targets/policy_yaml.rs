//! Policy YAML → `policy_file::parse` (every document: kind, apiVersion,
//! metadata, the CRD schema walk, typed fields, CEL rules, then resolution), as
//! a reload of a file or directory does.
//!
//! Input: the text of one file; a NUL byte starts a second file, so the
//! cross-file checks (duplicates, conflicts) are reached too.

#![no_main]

use std::path::PathBuf;

use inferencecache::adapters::policy_file::{self, Source};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The watcher reads files with read_to_string: text that is not UTF-8 never
    // gets here.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let sources: Vec<Source> = text
        .split('\0')
        .enumerate()
        .map(|(i, t)| Source {
            path: PathBuf::from(format!("policy/{i}.yaml")),
            text: t.to_string(),
        })
        .collect();
    match policy_file::parse(&sources) {
        Ok(loaded) => {
            let o = &loaded.objects;
            assert!(o.policies.len() + o.tenants.len() + o.backends.len() <= text.len());
            // The revision is a pure function of the sources (a watcher that saw
            // another revision for the same files would reload for nothing).
            match policy_file::parse(&sources) {
                Ok(again) => assert_eq!(again.snapshot.revision(), loaded.snapshot.revision()),
                Err(e) => panic!("the same sources loaded, then failed: {e}"),
            }
        }
        Err(e) => {
            // A failed load says why: at least one problem, none of them blank.
            assert!(!e.problems.is_empty());
            assert!(e.problems.iter().all(|p| !p.trim().is_empty()));
        }
    }
});
