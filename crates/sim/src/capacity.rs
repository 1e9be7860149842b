//! Capacity at a latency objective: what each router serves as the offered load
//! grows past what the fleet serves with no cache hits (`bench-routing --sweep`).
//!
//! Per workload the objective (SLO) is a fixed multiple of the time to first
//! token one request gets alone on an idle engine with nothing cached: any
//! router meets it with room to spare at low load, and a cache-blind router loses
//! it once requests wait for a couple of others' prefills. A router's capacity at
//! the SLO is the highest offered load whose p90 TTFT of *served* requests meets it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::report::RunSummary;
use super::router::Router;
use super::workload::{Fleet, Request};

/// The SLO as a multiple of the workload's solo, no-cache TTFT: a request may
/// wait for about two others' prefills of its size before it misses it.
pub const SLO_TTFT_MULTIPLE: f64 = 3.0;

/// The workload's TTFT objective on `fleet`, ms: [`SLO_TTFT_MULTIPLE`] × the mean
/// TTFT of `requests` each alone on an idle engine with nothing cached.
pub fn slo_ms(fleet: &Fleet, requests: &[Request]) -> f64 {
    SLO_TTFT_MULTIPLE * fleet.solo_ttft_ms(requests)
}

/// One router's run at one offered load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// × the fleet's no-cache capacity.
    pub load: f64,
    pub p90_ms: f64,
    /// Requests served (a run that served none does not meet any objective).
    pub served: usize,
}

/// Where a router's p90 TTFT of served requests crosses the objective.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Capacity {
    /// Already missed at the lowest load measured.
    Below { lowest: f64 },
    /// Met at `passing` (the highest load before the first miss) and missed at
    /// the next step; `interpolated` is where the p90 crosses the objective on
    /// the straight line between the two.
    Between {
        passing: f64,
        failing: f64,
        interpolated: f64,
    },
    /// Met at every load measured, up to `highest`.
    AtLeast { highest: f64 },
}

impl Capacity {
    /// The figure ratios are taken of: the interpolated crossing, the highest
    /// load measured when it never missed (a lower bound), 0 when it always did.
    pub fn value(&self) -> f64 {
        match *self {
            Self::Below { .. } => 0.0,
            Self::Between { interpolated, .. } => interpolated,
            Self::AtLeast { highest } => highest,
        }
    }

    /// The highest step that met the objective (0 when none did).
    pub fn passing(&self) -> f64 {
        match *self {
            Self::Below { .. } => 0.0,
            Self::Between { passing, .. } => passing,
            Self::AtLeast { highest } => highest,
        }
    }

    /// `1.73×`, `≥ 3×` or `< 0.5×`.
    pub fn describe(&self) -> String {
        match *self {
            Self::Below { lowest } => format!("< {lowest}×"),
            Self::Between { interpolated, .. } => format!("{interpolated:.2}×"),
            Self::AtLeast { highest } => format!("≥ {highest}×"),
        }
    }
}

/// The capacity at `slo_ms` of one router's points (any order): scanning up
/// from the lowest load, the first point whose p90 exceeds the objective (or
/// that served nothing) ends it. `None` without points.
pub fn capacity_at_slo(points: &[Point], slo_ms: f64) -> Option<Capacity> {
    let mut sorted = points.to_vec();
    sorted.sort_by(|a, b| a.load.total_cmp(&b.load));
    let meets = |p: &Point| p.served > 0 && p.p90_ms <= slo_ms;
    let first = sorted.first()?;
    let Some(miss) = sorted.iter().position(|p| !meets(p)) else {
        return Some(Capacity::AtLeast {
            highest: sorted[sorted.len() - 1].load,
        });
    };
    if miss == 0 {
        return Some(Capacity::Below { lowest: first.load });
    }
    let (a, b) = (sorted[miss - 1], sorted[miss]);
    // a.p90 ≤ slo < b.p90 when b served anything; a run that served nothing
    // gives no slope, so the crossing is the last passing step.
    let interpolated = if b.served > 0 && b.p90_ms > a.p90_ms {
        a.load + (b.load - a.load) * (slo_ms - a.p90_ms) / (b.p90_ms - a.p90_ms)
    } else {
        a.load
    };
    Some(Capacity::Between {
        passing: a.load,
        failing: b.load,
        interpolated,
    })
}

/// Each router's capacity on one workload, in the order the routers first appear.
pub fn capacities(runs: &[RunSummary]) -> Vec<(String, Capacity)> {
    let mut by_router: BTreeMap<&str, Vec<Point>> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for r in runs {
        if !by_router.contains_key(r.router.as_str()) {
            order.push(&r.router);
        }
        by_router.entry(&r.router).or_default().push(Point {
            load: r.load,
            p90_ms: r.ttft_p90_ms,
            served: r.requests - r.shed - r.errors,
        });
    }
    let slo = runs.first().map_or(0.0, |r| r.slo_ms);
    order
        .into_iter()
        .filter_map(|name| capacity_at_slo(&by_router[name], slo).map(|c| (name.to_string(), c)))
        .collect()
}

/// One workload's sweep as Markdown: every (router, load) row, then each
/// router's capacity at the SLO and inferencecache's standing against the
/// load balancers.
pub fn table(workload: &str, describe: &str, runs: &[RunSummary]) -> String {
    let mut out = String::new();
    let slo = runs.first().map_or(0.0, |r| r.slo_ms);
    let _ = writeln!(
        out,
        "### {workload}: capacity at p90 TTFT ≤ {slo:.0} ms\n\n{describe}\n"
    );
    let _ = writeln!(
        out,
        "| router | load | offered req/s | served | shed (429) | failed | goodput req/s | TTFT p50 ms | p90 ms | p99 ms | p90 ≤ SLO |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|");
    let mut sorted: Vec<&RunSummary> = runs.iter().collect();
    sorted.sort_by(|a, b| {
        let pos = |r: &RunSummary| runs.iter().position(|x| x.router == r.router);
        pos(a).cmp(&pos(b)).then(a.load.total_cmp(&b.load))
    });
    for r in sorted {
        let served = r.requests - r.shed - r.errors;
        let _ = writeln!(
            out,
            "| {} | {}× | {:.1} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
            r.router,
            r.load,
            r.offered_rps,
            served,
            r.shed,
            r.errors,
            r.goodput_rps,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            if served > 0 && r.ttft_p90_ms <= slo {
                "yes"
            } else {
                "no"
            }
        );
    }
    let caps = capacities(runs);
    let rate_per_load = runs
        .iter()
        .find(|r| r.load > 0.0)
        .map_or(0.0, |r| r.offered_rps / r.load);
    let _ = writeln!(
        out,
        "\nCapacity at the SLO (highest offered load whose p90 TTFT of served requests \
         meets it; interpolated between the last step that meets it and the first that \
         does not):\n"
    );
    let _ = writeln!(
        out,
        "| router | capacity (× no-cache) | req/s | highest passing step |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    for (router, c) in &caps {
        let _ = writeln!(
            out,
            "| {router} | {} | {:.1} | {}× |",
            c.describe(),
            c.value() * rate_per_load,
            c.passing()
        );
    }
    let find = |name: &str| caps.iter().find(|(r, _)| r == name).map(|(_, c)| *c);
    if let Some(ours) = find(Router::InferenceCache.name()) {
        let mut against = Vec::new();
        for lb in [Router::RoundRobin, Router::LeastRequest] {
            if let Some(theirs) = find(lb.name()) {
                against.push(format!("{} {}", lb.name(), capacity_ratio(ours, theirs)));
            }
        }
        if !against.is_empty() {
            let _ = writeln!(
                out,
                "\ninferencecache's capacity at the SLO ÷ {}.",
                against.join(", ")
            );
        }
    }
    out
}

/// `ours ÷ theirs` of two capacities, with `≥` when ours is only a lower bound
/// and `≤` when theirs is.
pub fn capacity_ratio(ours: Capacity, theirs: Capacity) -> String {
    let (a, b) = (ours.value(), theirs.value());
    if b <= 0.0 {
        return if a > 0.0 { "∞×" } else { "—" }.to_string();
    }
    let bound = match (ours, theirs) {
        (Capacity::AtLeast { .. }, Capacity::AtLeast { .. }) => {
            return "— (both meet it at every load)".to_string();
        }
        (Capacity::AtLeast { .. }, _) => "≥ ",
        (_, Capacity::AtLeast { .. }) => "≤ ",
        _ => "",
    };
    format!("{bound}{:.2}×", a / b)
}

#[cfg(test)]
mod tests;
