//! The sweep's plot as plain SVG text: prefill and generation t/s against context
//! tokens on one linear t/s axis, with ticks, axis labels and a legend.

use std::fmt::Write;

use super::sweep::Row;

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const TARGET_TICKS: f64 = 6.0;

struct Series {
    name: &'static str,
    color: &'static str,
    value: fn(&Row) -> f64,
}

const SERIES: [Series; 2] = [
    Series {
        name: "prefill t/s",
        color: "#1f77b4",
        value: |r| r.prefill_tps,
    },
    Series {
        name: "generation t/s",
        color: "#d62728",
        value: |r| r.gen_tps,
    },
];

pub fn svg(title: &str, rows: &[Row]) -> String {
    let x_axis = Axis::new(rows.iter().map(|r| r.ctx_tokens as f64).fold(0.0, f64::max));
    let y_axis = Axis::new(
        rows.iter()
            .flat_map(|r| SERIES.iter().map(move |s| (s.value)(r)))
            .fold(0.0, f64::max),
    );
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let px = |x: f64| LEFT + x / x_axis.max * plot_w;
    let py = |y: f64| TOP + plot_h - y / y_axis.max * plot_h;

    // `write!` to a String cannot fail; the results are ignored for brevity.
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="15">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    for (i, x) in x_axis.ticks().enumerate() {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1:.1}" stroke="{2}"/><text x="{0:.1}" y="{3:.1}" text-anchor="middle">{4}</text>"##,
            px(x),
            TOP + plot_h + 5.0,
            if i == 0 { "black" } else { "#e0e0e0" },
            TOP + plot_h + 20.0,
            x_axis.label(x)
        );
    }
    for (i, y) in y_axis.ticks().enumerate() {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{2:.1}" y2="{1:.1}" stroke="{3}"/><text x="{4:.1}" y="{5:.1}" text-anchor="end">{6}</text>"##,
            LEFT - 5.0,
            py(y),
            LEFT + plot_w,
            if i == 0 { "black" } else { "#e0e0e0" },
            LEFT - 8.0,
            py(y) + 4.0,
            y_axis.label(y)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">context tokens</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 15.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(20 {:.1}) rotate(-90)" text-anchor="middle">tokens per second</text>"#,
        TOP + plot_h / 2.0
    );
    for (i, series) in SERIES.iter().enumerate() {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .map(|r| (px(r.ctx_tokens as f64), py((series.value)(r))))
            .collect();
        let coords: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            series.color,
            coords.join(" ")
        );
        for (x, y) in &points {
            let _ = writeln!(
                s,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{}"/>"#,
                series.color
            );
        }
        let ly = TOP + 12.0 + 18.0 * i as f64;
        let lx = LEFT + plot_w - 150.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 24.0,
            series.color,
            lx + 30.0,
            ly + 4.0,
            series.name
        );
    }
    s.push_str("</svg>\n");
    s
}

/// A linear axis from 0 with "nice" tick steps (1, 2 or 5 times a power of ten).
struct Axis {
    step: f64,
    max: f64,
}

impl Axis {
    fn new(data_max: f64) -> Axis {
        let data_max = if data_max > 0.0 && data_max.is_finite() {
            data_max
        } else {
            1.0
        };
        let raw = data_max / TARGET_TICKS;
        let magnitude = 10f64.powf(raw.log10().floor());
        let step = magnitude
            * match raw / magnitude {
                n if n <= 1.0 => 1.0,
                n if n <= 2.0 => 2.0,
                n if n <= 5.0 => 5.0,
                _ => 10.0,
            };
        Axis {
            step,
            max: (data_max / step).ceil() * step,
        }
    }

    fn ticks(&self) -> impl Iterator<Item = f64> + '_ {
        let n = (self.max / self.step).round() as usize;
        (0..=n).map(|i| i as f64 * self.step)
    }

    fn label(&self, v: f64) -> String {
        let decimals = (-self.step.log10().floor()).max(0.0) as usize;
        format!("{v:.decimals$}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_steps_are_round_and_cover_the_data() {
        let a = Axis::new(8192.0);
        assert_eq!((a.step, a.max), (2000.0, 10000.0));
        let a = Axis::new(0.37);
        assert_eq!(a.label(0.1), "0.1");
        assert!(a.max >= 0.37 && a.ticks().count() <= 9);
    }

    #[test]
    fn svg_has_both_series_and_escapes_the_title() {
        let row = |ctx, pp, tg| Row {
            ctx_tokens: ctx,
            prefill_tokens: 64,
            prefill_tps: pp,
            gen_tokens: 4,
            gen_tps: tg,
            kvcache_bytes: 1,
        };
        let svg = svg("a<b", &[row(64, 100.0, 20.0), row(128, 90.0, 18.0)]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a&lt;b") && svg.contains("generation t/s"));
    }
}
