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
