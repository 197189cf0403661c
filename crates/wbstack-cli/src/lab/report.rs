//! `wbstack lab --report DIR`: one self-contained page (`DIR/index.html`, plots inline
//! as SVG, no script, no network), every plot's data in `DIR/ID.json`, and the whole
//! run in `DIR/run.json` (what ran, where, on which commit) for `--replay`.

use crate::lab::kernel::KernelRun;
use crate::lab::outln;
use crate::lab::plots::{self, Plot};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What a run was, so it can be told apart and run again.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunInfo {
    /// The command line as typed.
    pub command: String,
    /// The experiments, in order.
    pub experiments: Vec<String>,
    pub quick: bool,
    pub full: bool,
    /// `--kernel` (empty: none).
    pub kernel: Vec<String>,
    pub rounds: Option<usize>,
    pub runtime_ms: Option<u64>,
    pub git_commit: String,
    pub kernel_version: String,
    pub cpus: usize,
    /// Seconds since the epoch at the start.
    pub started_unix_s: u64,
    pub elapsed_s: f64,
}

/// One experiment's part of the report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Section {
    pub experiment: String,
    /// The table as the terminal shows it (with the seed's figures).
    pub table: String,
    /// The A/B ratios and what they mean, in two sentences.
    pub meaning: String,
    /// A command per arm that runs it alone.
    pub commands: Vec<String>,
    /// The experiment as `--json` prints it.
    pub data: serde_json::Value,
    pub plots: Vec<Plot>,
    #[serde(default)]
    pub kernel: Option<KernelRun>,
    #[serde(default)]
    pub kernel_table: String,
    pub elapsed_s: f64,
}

/// The whole run, as `DIR/run.json` holds it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Run {
    pub info: RunInfo,
    pub sections: Vec<Section>,
}

/// `write!` into a String, which cannot fail.
macro_rules! w {
    ($o:expr, $($t:tt)*) => {
        $o.push_str(&format!($($t)*))
    };
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn io(what: &Path) -> impl Fn(std::io::Error) -> String + '_ {
    move |e| format!("report: {}: {e}", what.display())
}

const STYLE: &str =
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}\
pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:12px;line-height:1.35}\
h2{border-bottom:1px solid #ccc;padding-top:1em}figure{margin:1em 0}\
figcaption{font-size:13px;color:#555}table.diff{border-collapse:collapse;font-size:13px}\
table.diff td,table.diff th{border:1px solid #ccc;padding:2px 6px;text-align:right}\
.meaning{font-size:15px;background:#eef5ff;padding:.6em .8em;border-left:4px solid #4a7fd4}";

/// Write `DIR/index.html`, `DIR/ID.json` per plot and `DIR/run.json`. With `before`
/// (a replay), each section also shows how its figures moved from the first run.
pub fn write(dir: &Path, run: &Run, before: Option<&Run>) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut html = String::new();
    let i = &run.info;
    let title = if before.is_some() {
        "wbstack lab: replay"
    } else {
        "wbstack lab"
    };
    w!(
        html,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title><style>{STYLE}</style></head><body>\n<h1>{title}</h1>\n"
    );
    w!(
        html,
        "<p>Command: <code>{}</code><br>git commit {}, kernel {}, {} CPUs, {} scale, {:.0} s in all.</p>\n",
        esc(&i.command),
        esc(&i.git_commit),
        esc(&i.kernel_version),
        i.cpus,
        if i.full {
            "full (--full)"
        } else if i.quick {
            "quick"
        } else {
            "default"
        },
        i.elapsed_s
    );
    if let Some(b) = before {
        w!(
            html,
            "<p>Replay of the run of {} (commit {}, kernel {}); each section ends with how its figures moved.</p>\n",
            esc(&b.info.command),
            esc(&b.info.git_commit),
            esc(&b.info.kernel_version)
        );
    }
    html.push_str("<ul>\n");
    for s in &run.sections {
        outln!(
            html,
            "<li><a href=\"#{0}\">{0}</a>: {1}</li>",
            esc(&s.experiment),
            esc(s.table.lines().next().unwrap_or(""))
        );
    }
    html.push_str("</ul>\n");
    for s in &run.sections {
        w!(
            html,
            "<section id=\"{0}\"><h2>{0}: {1}</h2>\n<p class=\"meaning\">{2}</p>\n<pre>{3}</pre>\n",
            esc(&s.experiment),
            esc(s.table.lines().next().unwrap_or("")),
            esc(&s.meaning),
            esc(&s.table)
        );
        for p in &s.plots {
            let svg = plots::render_svg(p)?;
            let json = dir.join(format!("{}.json", p.id));
            std::fs::write(
                &json,
                serde_json::to_string_pretty(p).map_err(|e| e.to_string())?,
            )
            .map_err(io(&json))?;
            w!(
                html,
                "<figure id=\"{0}\">{svg}<figcaption>{1} (data: <a href=\"{0}.json\">{0}.json</a>)</figcaption></figure>\n",
                esc(&p.id),
                esc(&p.title)
            );
        }
        if let Some(k) = &s.kernel {
            w!(
                html,
                "<h3>Beside the kernel, on this machine's disk</h3>\n<pre>{}</pre>\n",
                esc(&s.kernel_table)
            );
            for a in &k.arms {
                outln!(
                    html,
                    "<p><b>{}</b> on {} ({}): {}<br><code>{}</code></p>",
                    esc(&a.name),
                    esc(&a.target),
                    esc(&a.program),
                    esc(&a.setup),
                    esc(&a.commands.join(" ; "))
                );
            }
        }
        html.push_str("<h3>Re-run</h3>\n<pre>");
        outln!(
            html,
            "wbstack lab {}{}",
            esc(&s.experiment),
            crate::lab::scale_flag(i.quick, i.full)
        );
        for c in &s.commands {
            outln!(html, "{}", esc(c));
        }
        html.push_str("</pre>\n");
        if let Some(b) =
            before.and_then(|b| b.sections.iter().find(|x| x.experiment == s.experiment))
        {
            html.push_str(&diff_table(&b.data, &s.data));
            if let (Some(kb), Some(ka)) = (&b.kernel, &s.kernel) {
                html.push_str(&diff_table(&kernel_figures(kb), &kernel_figures(ka)));
            }
        }
        html.push_str("</section>\n");
    }
    html.push_str("</body></html>\n");
    let index = dir.join("index.html");
    std::fs::write(&index, html).map_err(io(&index))?;
    let rj = dir.join("run.json");
    std::fs::write(
        &rj,
        serde_json::to_string_pretty(run).map_err(|e| e.to_string())?,
    )
    .map_err(io(&rj))?;
    Ok(())
}

/// Every numeric figure of every arm, first run beside the replay, matched by the arm's
/// name.
pub fn diff_rows(
    before: &serde_json::Value,
    after: &serde_json::Value,
) -> Vec<(String, String, f64, f64)> {
    let mut rows = Vec::new();
    let arms = |v: &serde_json::Value| v["arms"].as_array().cloned().unwrap_or_default();
    let (b_arms, a_arms) = (arms(before), arms(after));
    for a in &a_arms {
        let name = a["name"].as_str().unwrap_or("").to_string();
        let Some(b) = b_arms.iter().find(|b| b["name"] == a["name"]) else {
            continue;
        };
        if let Some(fields) = a.as_object() {
            for (k, v) in fields {
                if let (Some(new), Some(old)) = (v.as_f64(), b[k].as_f64()) {
                    rows.push((name.clone(), k.clone(), old, new));
                }
            }
        }
    }
    rows
}

/// A kernel run's arms in the shape `diff_rows` reads: `{"arms": [{name, figures...}]}`.
fn kernel_figures(k: &KernelRun) -> serde_json::Value {
    let arms: Vec<serde_json::Value> = k
        .arms
        .iter()
        .map(|a| {
            let mut o = serde_json::Map::new();
            o.insert("name".into(), a.name.clone().into());
            for (f, v) in &a.figures {
                o.insert(f.clone(), (*v).into());
            }
            serde_json::Value::Object(o)
        })
        .collect();
    serde_json::json!({ "arms": arms })
}

fn diff_table(before: &serde_json::Value, after: &serde_json::Value) -> String {
    let rows = diff_rows(before, after);
    let mut h = String::from(
        "<h3>Differences from the first run</h3>\n<table class=\"diff\"><tr><th>arm</th><th>figure</th><th>first</th><th>replay</th><th>replay / first</th></tr>\n",
    );
    for (arm, k, old, new) in rows {
        let ratio = if old != 0.0 {
            format!("{:.3}", new / old)
        } else {
            "-".into()
        };
        outln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{old:.4}</td><td>{new:.4}</td><td>{ratio}</td></tr>",
            esc(&arm),
            esc(&k)
        );
    }
    h.push_str("</table>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::plots::PlotKind;

    fn run_of(v: f64) -> Run {
        Run {
            info: RunInfo {
                command: "wbstack lab plug --report r".into(),
                experiments: vec!["plug".into()],
                quick: true,
                full: false,
                kernel: vec![],
                rounds: None,
                runtime_ms: None,
                git_commit: "abc".into(),
                kernel_version: "6.18".into(),
                cpus: 2,
                started_unix_s: 0,
                elapsed_s: 1.0,
            },
            sections: vec![Section {
                experiment: "plug".into(),
                table: "seed 000 — <plug>\nrow".into(),
                meaning: "It helps.".into(),
                commands: vec!["wbstack bench fsmark ...".into()],
                data: serde_json::json!({"arms": [{"name": "off", "files_per_sec": v}]}),
                plots: vec![
                    Plot::new("plug-rate", "rate", PlotKind::Lines, "time (s)", "files/s")
                        .series("off", vec![(0.0, 1.0), (1.0, 2.0)]),
                ],
                kernel: None,
                kernel_table: String::new(),
                elapsed_s: 1.0,
            }],
        }
    }

    #[test]
    fn a_report_is_one_page_with_escaped_tables_inline_svg_and_plot_json() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &run_of(10.0), None).unwrap();
        let html = std::fs::read_to_string(d.path().join("index.html")).unwrap();
        assert!(html.contains("&lt;plug&gt;"), "tables are escaped");
        assert_eq!(html.matches("<svg").count(), 1);
        assert!(!html.contains("<script"));
        let p: Plot = serde_json::from_str(
            &std::fs::read_to_string(d.path().join("plug-rate.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(p.point_count(), 2);
        let r: Run =
            serde_json::from_str(&std::fs::read_to_string(d.path().join("run.json")).unwrap())
                .unwrap();
        assert_eq!(r.info.experiments, vec!["plug".to_string()]);
    }

    #[test]
    fn a_replay_diffs_the_kernel_arms_too() {
        let kr = |v: f64| KernelRun {
            experiment: "plug".into(),
            arms: vec![crate::lab::kernel::TargetArm {
                name: "ext4 -S0".into(),
                target: "ext4".into(),
                program: "fs_mark".into(),
                commands: vec![],
                setup: String::new(),
                figures: [("files_per_sec".to_string(), v)].into_iter().collect(),
                series: Default::default(),
            }],
            skipped: vec![],
        };
        let rows = diff_rows(&kernel_figures(&kr(100.0)), &kernel_figures(&kr(80.0)));
        assert_eq!(
            rows,
            vec![("ext4 -S0".into(), "files_per_sec".into(), 100.0, 80.0)]
        );
    }

    #[test]
    fn a_replay_shows_each_figure_beside_the_first_run() {
        let rows = diff_rows(
            &run_of(10.0).sections[0].data,
            &run_of(15.0).sections[0].data,
        );
        assert_eq!(
            rows,
            vec![("off".into(), "files_per_sec".into(), 10.0, 15.0)]
        );
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &run_of(15.0), Some(&run_of(10.0))).unwrap();
        let html = std::fs::read_to_string(d.path().join("index.html")).unwrap();
        assert!(html.contains("Differences from the first run") && html.contains("1.500"));
    }
}
