//! The benchmark chart: per workload, the hit rate of each router (bars) and the
//! distribution of time to first token (CDF, log scale), as one SVG.

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

use super::report::RunSummary;

const COLORS: [RGBColor; 5] = [
    RGBColor(0x9e, 0x9e, 0x9e),
    RGBColor(0x79, 0x55, 0x48),
    RGBColor(0xff, 0x98, 0x00),
    RGBColor(0x1e, 0x88, 0xe5),
    RGBColor(0x43, 0xa0, 0x47),
];

/// Writes `path`: one row per workload (`runs` grouped by workload, in order).
pub fn write_svg(path: &Path, workloads: &[(String, Vec<RunSummary>)]) -> anyhow::Result<()> {
    let rows = workloads.len().max(1);
    let root = SVGBackend::new(path, (1100, 340 * rows as u32)).into_drawing_area();
    draw(&root, workloads).map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
    root.present()
        .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    workloads: &[(String, Vec<RunSummary>)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let rows = root.split_evenly((workloads.len().max(1), 2));
    for (i, (workload, runs)) in workloads.iter().enumerate() {
        let names: Vec<&str> = runs.iter().map(|r| r.router.as_str()).collect();
        let mut bars = ChartBuilder::on(&rows[2 * i])
            .caption(
                format!("{workload}: prefix-cache hit rate (%)"),
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d((0..runs.len()).into_segmented(), 0.0..100.0)?;
        bars.configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => names.get(*i).copied().unwrap_or("").to_string(),
                _ => String::new(),
            })
            .draw()?;
        for (j, r) in runs.iter().enumerate() {
            let color = COLORS[j % COLORS.len()];
            bars.draw_series(
                Histogram::vertical(&bars)
                    .style(color.filled())
                    .margin(12)
                    .data([(j, r.hit_rate * 100.0)]),
            )?;
        }

        let max = runs
            .iter()
            .flat_map(|r| r.ttfts_ms.last().copied())
            .fold(1.0f64, f64::max);
        let mut cdf = ChartBuilder::on(&rows[2 * i + 1])
            .caption(
                format!("{workload}: TTFT CDF (ms, log)"),
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d((0.5f64..max * 1.5).log_scale(), 0.0..1.0)?;
        cdf.configure_mesh().draw()?;
        for (j, r) in runs.iter().enumerate() {
            let color = COLORS[j % COLORS.len()];
            let n = r.ttfts_ms.len().max(1) as f64;
            let points = r
                .ttfts_ms
                .iter()
                .enumerate()
                .map(|(k, &t)| (t.max(0.5), (k + 1) as f64 / n));
            cdf.draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(r.router.clone())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        cdf.configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

/// The capacity chart (`--sweep`): per workload, goodput against offered load
/// and p90 TTFT of served requests against offered load (log scale, the SLO as
/// a dashed line), one line per router.
pub fn write_capacity_svg(
    path: &Path,
    workloads: &[(String, Vec<RunSummary>)],
) -> anyhow::Result<()> {
    let rows = workloads.len().max(1);
    let root = SVGBackend::new(path, (1100, 340 * rows as u32)).into_drawing_area();
    draw_capacity(&root, workloads).map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
    root.present()
        .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// The routers of `runs` in first-seen order, each with its points by load.
fn by_router(runs: &[RunSummary]) -> Vec<(&str, Vec<&RunSummary>)> {
    let mut out: Vec<(&str, Vec<&RunSummary>)> = Vec::new();
    for r in runs {
        match out.iter_mut().find(|(n, _)| *n == r.router) {
            Some((_, v)) => v.push(r),
            None => out.push((&r.router, vec![r])),
        }
    }
    for (_, v) in &mut out {
        v.sort_by(|a, b| a.load.total_cmp(&b.load));
    }
    out
}

fn draw_capacity<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    workloads: &[(String, Vec<RunSummary>)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let rows = root.split_evenly((workloads.len().max(1), 2));
    for (i, (workload, runs)) in workloads.iter().enumerate() {
        let routers = by_router(runs);
        let max_load = runs.iter().map(|r| r.load).fold(0.5f64, f64::max);
        let max_rps = runs
            .iter()
            .map(|r| r.offered_rps.max(r.goodput_rps))
            .fold(1.0f64, f64::max);
        let mut good = ChartBuilder::on(&rows[2 * i])
            .caption(
                format!("{workload}: goodput (req/s within SLO) vs offered load"),
                ("sans-serif", 16),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(0.0..max_load * 1.05, 0.0..max_rps * 1.05)?;
        good.configure_mesh().x_desc("× no-cache capacity").draw()?;
        for (j, (name, points)) in routers.iter().enumerate() {
            let color = COLORS[j % COLORS.len()];
            let line = points.iter().map(|r| (r.load, r.goodput_rps));
            good.draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                .label(name.to_string())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                });
            good.draw_series(line.map(|p| Circle::new(p, 3, color.filled())))?;
        }
        good.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;

        let slo = runs.first().map_or(1.0, |r| r.slo_ms.max(0.5));
        let max_p90 = runs.iter().map(|r| r.ttft_p90_ms).fold(slo, f64::max);
        let mut p90 = ChartBuilder::on(&rows[2 * i + 1])
            .caption(
                format!("{workload}: p90 TTFT of served (ms, log); SLO {slo:.0} ms dashed"),
                ("sans-serif", 16),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(0.0..max_load * 1.05, (1.0f64..max_p90 * 1.5).log_scale())?;
        p90.configure_mesh().x_desc("× no-cache capacity").draw()?;
        p90.draw_series(DashedLineSeries::new(
            [(0.0, slo), (max_load * 1.05, slo)],
            6,
            4,
            BLACK.stroke_width(1),
        ))?;
        for (j, (_, points)) in routers.iter().enumerate() {
            let color = COLORS[j % COLORS.len()];
            let line = points.iter().map(|r| (r.load, r.ttft_p90_ms.max(1.0)));
            p90.draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?;
            p90.draw_series(line.map(|p| Circle::new(p, 3, color.filled())))?;
        }
    }
    Ok(())
}
