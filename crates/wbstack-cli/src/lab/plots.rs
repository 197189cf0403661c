//! The report's plots: data in one serializable shape (written to `DIR/ID.json`) and
//! drawn to SVG with plotters, so the page needs no script and each plot's points are
//! exactly those of its JSON.

use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// Most points a line keeps: enough for a smooth curve, few enough for a light page.
pub const MAX_POINTS: usize = 600;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlotKind {
    /// Lines over a numeric x (time).
    Lines,
    /// Dots, one per point (per-inode figures).
    Points,
    /// Bars: x is the index of a category in `categories`, one bar per series within it.
    Bars,
    /// Latency percentiles: x is the percentile (50..99.9999) drawn on a "nines" scale.
    Percentiles,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plot {
    /// File stem of its JSON and the anchor in the page: "plug-rate".
    pub id: String,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub kind: PlotKind,
    pub log_y: bool,
    /// Bar categories (x labels), for `Bars`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub categories: Vec<String>,
    pub series: Vec<Series>,
}

impl Plot {
    pub fn new(id: &str, title: &str, kind: PlotKind, x_label: &str, y_label: &str) -> Plot {
        Plot {
            id: id.into(),
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            kind,
            log_y: false,
            categories: Vec::new(),
            series: Vec::new(),
        }
    }

    pub fn log_y(mut self) -> Plot {
        self.log_y = true;
        self
    }

    pub fn categories(mut self, c: Vec<String>) -> Plot {
        self.categories = c;
        self
    }

    /// Add a series, keeping finite points only (and at most `MAX_POINTS` for lines,
    /// evenly thinned), so the JSON holds what is drawn.
    pub fn series(mut self, name: &str, points: Vec<(f64, f64)>) -> Plot {
        let mut p: Vec<(f64, f64)> = points
            .into_iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!self.log_y || *y > 0.0))
            .collect();
        if self.kind == PlotKind::Lines && p.len() > MAX_POINTS {
            let step = p.len().div_ceil(MAX_POINTS);
            let last = p[p.len() - 1];
            p = p.into_iter().step_by(step).collect();
            if p.last() != Some(&last) {
                p.push(last);
            }
        }
        self.series.push(Series {
            name: name.into(),
            points: p,
        });
        self
    }

    pub fn point_count(&self) -> usize {
        self.series.iter().map(|s| s.points.len()).sum()
    }
}

/// An axis label: 12000 → "12k", 2.5e6 → "2.5M", 0.6000000001 → "0.6".
pub fn tick(v: f64) -> String {
    let a = v.abs();
    let (n, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let s = format!("{n:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}{suffix}")
}

/// The x position of percentile `p` on the nines scale: 50 → 0.3, 99 → 2, 99.99 → 4.
pub fn nines(p: f64) -> f64 {
    -(1.0 - p / 100.0).log10()
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

pub const WIDTH: u32 = 960;
/// Room right of the axes for the legend, so it never hides a line.
const LEGEND_PX: i32 = 220;
pub const HEIGHT: u32 = 380;

fn range(v: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for x in v {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    if !lo.is_finite() || !hi.is_finite() {
        return if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    if log {
        (lo.max(1e-9) / 1.5, hi * 1.5)
    } else {
        let lo = lo.min(0.0);
        let hi = if hi <= lo { lo + 1.0 } else { hi * 1.05 };
        (lo, hi)
    }
}

fn e<T: std::fmt::Display>(x: T) -> String {
    format!("plot: {x}")
}

/// Draw a plot to an SVG document.
pub fn render_svg(p: &Plot) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let xs = || p.series.iter().flat_map(|s| s.points.iter().map(|q| q.0));
        let ys = || p.series.iter().flat_map(|s| s.points.iter().map(|q| q.1));
        match p.kind {
            PlotKind::Bars => draw_bars(&root, p)?,
            _ => {
                let (x0, x1) = range(xs(), false);
                let (x0, x1) = if p.kind == PlotKind::Lines || p.kind == PlotKind::Points {
                    (x0.min(0.0), x1)
                } else {
                    (x0, x1)
                };
                let (y0, y1) = range(ys(), p.log_y);
                let mut b = ChartBuilder::on(&root);
                b.caption(&p.title, ("sans-serif", 20))
                    .margin(10)
                    .margin_right(LEGEND_PX)
                    .x_label_area_size(40)
                    .y_label_area_size(70);
                if p.log_y {
                    let mut c = b
                        .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
                        .map_err(e)?;
                    draw_chart(&root, &mut c, p)?;
                } else {
                    let mut c = b.build_cartesian_2d(x0..x1, y0..y1).map_err(e)?;
                    draw_chart(&root, &mut c, p)?;
                }
            }
        }
        root.present().map_err(e)?;
    }
    Ok(svg)
}

/// A chart over a numeric x, with a linear or log y.
type Chart<'a, Y> =
    ChartContext<'a, SVGBackend<'a>, Cartesian2d<plotters::coord::types::RangedCoordf64, Y>>;

/// Axes, lines or dots, legend: one chart, whatever its y scale.
fn draw_chart<'a, Y>(
    root: &DrawingArea<SVGBackend<'a>, plotters::coord::Shift>,
    c: &mut Chart<'a, Y>,
    p: &Plot,
) -> Result<(), String>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let pct = p.kind == PlotKind::Percentiles;
    let fmt_x = move |x: &f64| {
        if pct {
            // Back from the nines scale to the percentile it stands for.
            let v = 100.0 * (1.0 - 10f64.powf(-x));
            format!("{}", (v * 10_000.0).round() / 10_000.0)
        } else {
            tick(*x)
        }
    };
    c.configure_mesh()
        .x_desc(&p.x_label)
        .y_desc(&p.y_label)
        .axis_desc_style(("sans-serif", 15))
        .label_style(("sans-serif", 13))
        .x_label_formatter(&fmt_x)
        .y_label_formatter(&|y: &f64| tick(*y))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(e)?;
    draw_series(c, p)?;
    legend(root, c, p)
}

fn draw_series<'a, Y>(c: &mut Chart<'a, Y>, p: &Plot) -> Result<(), String>
where
    Y: Ranged<ValueType = f64>,
{
    for (i, s) in p.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        match p.kind {
            PlotKind::Points => c
                .draw_series(
                    s.points
                        .iter()
                        .map(|&q| Circle::new(q, 2, color.mix(0.6).filled())),
                )
                .map_err(e)?,
            _ => c
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(e)?,
        };
    }
    Ok(())
}

/// The legend, right of the axes (plotters' own legend is clipped to the plotting area,
/// where it would hide lines).
fn legend<'a, X, Y>(
    root: &DrawingArea<SVGBackend<'a>, plotters::coord::Shift>,
    c: &ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    p: &Plot,
) -> Result<(), String>
where
    X: Ranged,
    Y: Ranged,
{
    let (xr, yr) = c.plotting_area().get_pixel_range();
    let x = xr.end + 12;
    for (i, s) in p.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let y = yr.start + 8 + 20 * i as i32;
        match p.kind {
            PlotKind::Bars => root
                .draw(&Rectangle::new(
                    [(x, y - 5), (x + 14, y + 5)],
                    color.filled(),
                ))
                .map_err(e)?,
            PlotKind::Points => root
                .draw(&Circle::new((x + 7, y), 4, color.filled()))
                .map_err(e)?,
            _ => root
                .draw(&PathElement::new(
                    vec![(x, y), (x + 18, y)],
                    color.stroke_width(3),
                ))
                .map_err(e)?,
        }
        root.draw(&Text::new(
            s.name.clone(),
            (x + 24, y - 7),
            ("sans-serif", 13).into_font(),
        ))
        .map_err(e)?;
    }
    Ok(())
}

fn draw_bars(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    p: &Plot,
) -> Result<(), String> {
    let ncat = p.categories.len().max(1);
    let nser = p.series.len().max(1);
    let (y0, y1) = range(
        p.series.iter().flat_map(|s| s.points.iter().map(|q| q.1)),
        p.log_y,
    );
    let cats = p.categories.clone();
    let mut c = ChartBuilder::on(root)
        .caption(&p.title, ("sans-serif", 20))
        .margin(10)
        .margin_right(LEGEND_PX)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..(ncat as f64 - 0.5), y0.min(0.0)..y1)
        .map_err(e)?;
    c.configure_mesh()
        .x_desc(&p.x_label)
        .y_desc(&p.y_label)
        .axis_desc_style(("sans-serif", 15))
        .label_style(("sans-serif", 13))
        .x_labels(ncat)
        .x_label_formatter(&|x: &f64| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 {
                cats.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y: &f64| tick(*y))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(e)?;
    let width = 0.8 / nser as f64;
    for (i, s) in p.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        c.draw_series(s.points.iter().map(|&(x, y)| {
            let left = x - 0.4 + width * i as f64;
            Rectangle::new([(left, 0.0), (left + width * 0.95, y)], color.filled())
        }))
        .map_err(e)?;
    }
    legend(root, &c, p)
}

/// The number of points of every `<polyline>` in an SVG (tests and the report's check).
pub fn svg_polyline_points(svg: &str) -> Vec<usize> {
    svg.split("<polyline")
        .skip(1)
        .filter_map(|s| {
            let i = s.find("points=\"")? + 8;
            let j = s[i..].find('"')?;
            Some(s[i..i + j].split_whitespace().count())
        })
        .collect()
}

/// The text of every `<text>` element of an SVG, trimmed and unescaped.
pub fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|s| {
            let i = s.find('>')? + 1;
            let j = s[i..].find("</text>")?;
            Some(unescape(s[i..i + j].trim()))
        })
        .collect()
}

/// Back from SVG's escaped text to the string drawn.
pub fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_plot_draws_one_polyline_per_series_with_its_points() {
        let p = Plot::new(
            "t",
            "Files over time",
            PlotKind::Lines,
            "time (s)",
            "files/s",
        )
        .series("off", vec![(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)])
        .series("on", vec![(0.0, 2.0), (1.0, f64::NAN), (2.0, 5.0)]);
        assert_eq!(p.series[1].points.len(), 2, "non-finite points are dropped");
        let svg = render_svg(&p).unwrap();
        assert!(svg.starts_with("<svg"));
        let texts = svg_texts(&svg);
        for t in ["Files over time", "files/s", "time (s)", "off", "on"] {
            assert!(texts.iter().any(|x| x == t), "{t} missing from {texts:?}");
        }
        let lines = svg_polyline_points(&svg);
        assert!(lines.contains(&3) && lines.contains(&2), "{lines:?}");
    }

    #[test]
    fn bars_percentiles_and_points_render() {
        let b = Plot::new("b", "IOPS", PlotKind::Bars, "jobs", "IOPS")
            .categories(vec!["2".into(), "32".into()])
            .series("off", vec![(0.0, 10.0), (1.0, 20.0)])
            .series("tags", vec![(0.0, 9.0), (1.0, 19.0)]);
        let svg = render_svg(&b).unwrap();
        assert!(svg.matches("<rect").count() >= 4);
        let pc = Plot::new(
            "p",
            "Read latency",
            PlotKind::Percentiles,
            "percentile",
            "usec",
        )
        .log_y()
        .series("off", vec![(nines(50.0), 40.0), (nines(99.99), 17000.0)]);
        assert!(svg_texts(&render_svg(&pc).unwrap())
            .iter()
            .any(|t| t == "99.99"));
        let pt = Plot::new("s", "Delay", PlotKind::Points, "inode", "s")
            .series("a", vec![(1.0, 2.0), (2.0, 3.0)]);
        // Two points and the legend's marker.
        assert_eq!(render_svg(&pt).unwrap().matches("<circle").count(), 3);
    }

    #[test]
    fn long_lines_are_thinned_and_keep_their_last_point() {
        let pts: Vec<(f64, f64)> = (0..5000).map(|i| (i as f64, i as f64)).collect();
        let p = Plot::new("t", "t", PlotKind::Lines, "x", "y").series("s", pts);
        let n = p.series[0].points.len();
        assert!(n <= MAX_POINTS + 1, "{n}");
        assert_eq!(p.series[0].points.last(), Some(&(4999.0, 4999.0)));
    }

    #[test]
    fn axis_labels_are_short() {
        assert_eq!(tick(0.6000000000001), "0.6");
        assert_eq!(tick(12000.0), "12k");
        assert_eq!(tick(2_500_000.0), "2.5M");
        assert_eq!(tick(3.0), "3");
        assert_eq!(tick(-2.0), "-2");
    }

    #[test]
    fn the_nines_scale_spaces_percentiles_by_their_nines() {
        assert!((nines(99.0) - 2.0).abs() < 1e-9);
        assert!((nines(99.99) - 4.0).abs() < 1e-9);
    }
}
