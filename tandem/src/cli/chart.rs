//! Small SVG charts for the simulator's and tuner's reports: step lines or dots on linear axes, and grouped bars.
//! Plain text out, no dependencies; each chart is one self-contained file a browser opens.

use std::fmt::Write;

const W: f64 = 720.0;
const H: f64 = 420.0;
/// Plot area margins: left, right, top, bottom.
const M: (f64, f64, f64, f64) = (70.0, 170.0, 40.0, 50.0);
const COLOURS: [&str; 10] =
    ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// A step line (the value holds until the next point): queues over time, CDFs.
    Steps,
    Dots,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub mark: Mark,
}

/// A chart of series over shared axes.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

impl Chart {
    pub fn svg(&self) -> String {
        let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
        let all: Vec<(f64, f64)> = self.series.iter().flat_map(|s| s.points.iter().filter(finite).copied()).collect();
        let (x0, x1) = bounds(all.iter().map(|p| p.0));
        let (y0, y1) = bounds(all.iter().map(|p| p.1).chain([0.0]));
        let px = |x: f64| M.0 + (x - x0) / (x1 - x0) * (W - M.0 - M.1);
        let py = |y: f64| H - M.3 - (y - y0) / (y1 - y0) * (H - M.2 - M.3);
        let mut out = frame(&self.title, &self.x_label, &self.y_label);
        axes(&mut out, (x0, x1), (y0, y1), &px, &py);
        for (k, s) in self.series.iter().enumerate() {
            let c = COLOURS[k % COLOURS.len()];
            let pts: Vec<(f64, f64)> = s.points.iter().filter(finite).map(|&(x, y)| (px(x), py(y))).collect();
            match s.mark {
                Mark::Dots => {
                    for (x, y) in &pts {
                        let _ =
                            write!(out, r#"<circle cx="{x:.1}" cy="{y:.1}" r="2.5" fill="{c}" fill-opacity="0.7"/>"#);
                    }
                }
                Mark::Steps => {
                    let mut d = String::new();
                    for (i, (x, y)) in pts.iter().enumerate() {
                        if i == 0 {
                            let _ = write!(d, "M{x:.1},{y:.1}");
                        } else {
                            let _ = write!(d, " H{x:.1} V{y:.1}");
                        }
                    }
                    let _ = write!(out, r#"<path d="{d}" fill="none" stroke="{c}" stroke-width="1.5"/>"#);
                }
            }
            legend(&mut out, k, &s.name, c);
        }
        out.push_str("</svg>\n");
        out
    }
}

/// Grouped bars: one group per label, one bar per series within it.
pub fn bars(title: &str, y_label: &str, groups: &[String], series: &[(String, Vec<f64>)]) -> String {
    let (_, y1) = bounds(series.iter().flat_map(|(_, v)| v.iter().copied()).chain([0.0]));
    let py = |y: f64| H - M.3 - y / y1 * (H - M.2 - M.3);
    let mut out = frame(title, "", y_label);
    axes(&mut out, (0.0, 1.0), (0.0, y1), &|_| f64::NAN, &py);
    let group_w = (W - M.0 - M.1) / groups.len().max(1) as f64;
    let bar_w = group_w * 0.8 / series.len().max(1) as f64;
    for (g, label) in groups.iter().enumerate() {
        let gx = M.0 + g as f64 * group_w;
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"#,
            gx + group_w / 2.0,
            H - M.3 + 16.0,
            escape(label)
        );
        for (k, (_, values)) in series.iter().enumerate() {
            let v = values.get(g).copied().unwrap_or(0.0).max(0.0);
            let x = gx + group_w * 0.1 + k as f64 * bar_w;
            let _ = write!(
                out,
                r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                py(v),
                bar_w * 0.9,
                H - M.3 - py(v),
                COLOURS[k % COLOURS.len()]
            );
        }
    }
    for (k, (name, _)) in series.iter().enumerate() {
        legend(&mut out, k, name, COLOURS[k % COLOURS.len()]);
    }
    out.push_str("</svg>\n");
    out
}

/// The empirical CDF of `values`: (value, share of values at or below it).
pub fn cdf(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect()
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) =
        values.filter(|x| x.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo < 1e-12 { (lo - 0.5, hi + 0.5) } else { (lo, hi + (hi - lo) * 0.02) }
}

fn frame(title: &str, x_label: &str, y_label: &str) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif"><rect width="{W}" height="{H}" fill="white"/><text x="{:.1}" y="24" text-anchor="middle" font-size="15">{}</text><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="12">{}</text><text x="16" y="{:.1}" text-anchor="middle" font-size="12" transform="rotate(-90 16 {:.1})">{}</text>"#,
        W / 2.0,
        escape(title),
        M.0 + (W - M.0 - M.1) / 2.0,
        H - 10.0,
        escape(x_label),
        H / 2.0,
        H / 2.0,
        escape(y_label)
    );
    out
}

/// The plot box with five ticks on each axis (none on x when `px` gives NaN: bar charts).
fn axes(out: &mut String, x: (f64, f64), y: (f64, f64), px: &dyn Fn(f64) -> f64, py: &dyn Fn(f64) -> f64) {
    let _ = write!(
        out,
        r#"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="black"/>"#,
        M.0,
        M.2,
        W - M.0 - M.1,
        H - M.2 - M.3
    );
    for i in 0..=4 {
        let v = y.0 + (y.1 - y.0) * i as f64 / 4.0;
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="10">{}</text><line x1="{}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="black" stroke-opacity="0.1"/>"#,
            M.0 - 4.0,
            py(v) + 3.0,
            tick(v),
            M.0,
            W - M.1,
            py(v),
            py(v)
        );
        let u = x.0 + (x.1 - x.0) * i as f64 / 4.0;
        if px(u).is_finite() {
            let _ = write!(
                out,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"#,
                px(u),
                H - M.3 + 14.0,
                tick(u)
            );
        }
    }
}

fn legend(out: &mut String, k: usize, name: &str, colour: &str) {
    let y = M.2 + 10.0 + k as f64 * 16.0;
    let x = W - M.1 + 10.0;
    let _ = write!(
        out,
        r#"<rect x="{x}" y="{:.1}" width="10" height="10" fill="{colour}"/><text x="{}" y="{:.1}" font-size="11">{}</text>"#,
        y - 9.0,
        x + 14.0,
        y,
        escape(name)
    );
}

fn tick(v: f64) -> String {
    match v.abs() {
        a if a >= 1e5 => format!("{v:.2e}"),
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 1.0 => format!("{v:.1}"),
        _ => format!("{v:.3}"),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_rises_to_one_over_sorted_values() {
        assert_eq!(cdf(&[3.0, 1.0, f64::NAN, 2.0]), vec![(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]);
    }

    #[test]
    fn charts_are_one_well_formed_svg_with_every_series() {
        let chart = Chart {
            title: "a <b>".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![
                Series { name: "kv".into(), points: vec![(0.0, 1.0), (1.0, 2.0)], mark: Mark::Steps },
                Series { name: "rr".into(), points: vec![(0.5, f64::NAN), (2.0, 3.0)], mark: Mark::Dots },
            ],
        };
        let svg = chart.svg();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &lt;b&gt;") && svg.contains(">kv<") && svg.contains(">rr<"));
        assert_eq!(svg.matches("<circle").count(), 1, "the NaN point is left out");
        assert!(!svg.contains("NaN"));
        let b = bars("hits", "tokens", &["kv".into()], &[("device".into(), vec![5.0]), ("host".into(), vec![0.0])]);
        assert_eq!(b.matches("<rect").count(), 2 + 2 + 2, "background, plot box, two bars, two legend keys");
    }
}
