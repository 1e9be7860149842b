//! The core's top-level modules form a DAG: a module may use the ones below it,
//! never one that uses it back (the load signals, for one, know nothing of the
//! index that holds them). Read from the sources, so a new `use` that closes a
//! cycle fails here, not in review.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            // Unit tests may reach anywhere; only product code is layered.
            if p.file_name().is_some_and(|n| n != "tests") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs")
            && p.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(p);
        }
    }
}

/// Top-level module → the other top-level modules its code names as `crate::x`.
fn module_uses(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph = BTreeMap::new();
    for entry in fs::read_dir(src).expect("crates/core/src").flatten() {
        let path = entry.path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().is_none_or(|x| x != "rs") || stem == "lib" {
            continue;
        }
        let mut files = vec![path.clone()];
        rust_files(&src.join(stem), &mut files);
        let mut uses = BTreeSet::new();
        for f in files {
            let text = fs::read_to_string(&f).expect("readable source");
            for line in text.lines() {
                let code = line.split("//").next().unwrap_or("");
                for (i, _) in code.match_indices("crate::") {
                    let rest = &code[i + "crate::".len()..];
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() && name != stem {
                        uses.insert(name);
                    }
                }
            }
        }
        graph.insert(stem.to_string(), uses);
    }
    graph
}

fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if graph.contains_key(next)
                && let Some(c) = visit(next, graph, path, done)
            {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_core_modules_form_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_uses(&src);
    assert!(graph.contains_key("index") && graph.contains_key("load"));
    assert!(
        graph["index"].contains("load"),
        "the index holds each replica's load signals"
    );
    assert_eq!(find_cycle(&graph), None, "module graph: {graph:#?}");
}

#[test]
fn a_cycle_is_found() {
    let mut graph = BTreeMap::new();
    graph.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    graph.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["a".to_string(), "b".to_string(), "a".to_string()])
    );
}
