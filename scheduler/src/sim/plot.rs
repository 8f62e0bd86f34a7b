//! The replay's picture: queue length and GPU allocation / useful utilization over time, one
//! line per policy, written as SVG (no system fonts needed).

use super::metrics::Sample;
use crate::error::{Error, Result};
use plotters::prelude::*;

/// One plotted point: (hours, pending jobs, allocation %, useful %).
type Point = (f64, f64, f64, f64);

/// Averages samples into `buckets` equal time slices: (hours, pending, alloc %, busy %).
fn downsample(
    series: &[Sample],
    total_gpus: u32,
    end: i64,
    buckets: usize,
) -> Vec<(f64, f64, f64, f64)> {
    let mut out = Vec::with_capacity(buckets);
    if series.is_empty() || end <= 0 {
        return out;
    }
    let width = (end as f64 / buckets as f64).max(1.0);
    let mut idx = 0;
    let mut cur = series[0];
    for b in 0..buckets {
        let (lo, hi) = (b as f64 * width, (b + 1) as f64 * width);
        let (mut p, mut a, mut u, mut w) = (0.0, 0.0, 0.0, 0.0);
        let mut t = lo;
        while t < hi {
            while idx < series.len() && (series[idx].t as f64) <= t {
                cur = series[idx];
                idx += 1;
            }
            let next = series.get(idx).map_or(hi, |s| (s.t as f64).min(hi));
            let dt = (next - t).max(0.0);
            p += cur.pending as f64 * dt;
            a += cur.allocated as f64 * dt;
            u += cur.busy as f64 * dt;
            w += dt;
            if next <= t {
                break;
            }
            t = next;
        }
        // Samples count hundredths of a GPU.
        let g = 100.0 * total_gpus.max(1) as f64;
        if w > 0.0 {
            out.push((
                (lo + hi) / 2.0 / 3.6e6,
                p / w,
                100.0 * a / w / g,
                100.0 * u / w / g,
            ));
        }
    }
    out
}

/// Writes `path`: top panel queue length, bottom panel allocation (solid) and useful
/// utilization (dashed) in percent, per named series.
pub fn write_svg(path: &str, title: &str, runs: &[(String, u32, Vec<Sample>)]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| Error::Plot {
        path: path.to_string(),
        message: e.to_string(),
    };
    let end = runs
        .iter()
        .filter_map(|(_, _, s)| s.last().map(|x| x.t))
        .max()
        .unwrap_or(1);
    let data: Vec<(String, Vec<Point>)> = runs
        .iter()
        .map(|(n, g, s)| (n.clone(), downsample(s, *g, end, 600)))
        .collect();
    let hours = end as f64 / 3.6e6;
    let max_q = data
        .iter()
        .flat_map(|(_, d)| d.iter().map(|x| x.1))
        .fold(1.0, f64::max);
    let root = SVGBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (top, bottom) = root.split_vertically(400);
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    let mut q = ChartBuilder::on(&top)
        .caption(format!("{title}: jobs waiting"), ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..hours, 0.0..max_q * 1.05)
        .map_err(|e| err(&e))?;
    q.configure_mesh()
        .x_desc("hours")
        .y_desc("pending jobs")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, d)) in data.iter().enumerate() {
        let c = colors[i % colors.len()];
        q.draw_series(LineSeries::new(d.iter().map(|x| (x.0, x.1)), c))
            .map_err(|e| err(&e))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    q.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| err(&e))?;
    let mut u = ChartBuilder::on(&bottom)
        .caption(
            "GPU allocation (solid) and useful utilization (dashed), %",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..hours, 0.0..105.0)
        .map_err(|e| err(&e))?;
    u.configure_mesh()
        .x_desc("hours")
        .y_desc("% of GPUs")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (_, d)) in data.iter().enumerate() {
        let c = colors[i % colors.len()];
        u.draw_series(LineSeries::new(d.iter().map(|x| (x.0, x.2)), c))
            .map_err(|e| err(&e))?;
        u.draw_series(DashedLineSeries::new(
            d.iter().map(|x| (x.0, x.3)),
            6,
            4,
            c.into(),
        ))
        .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
