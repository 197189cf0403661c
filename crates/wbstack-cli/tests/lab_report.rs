//! `wbstack lab --report DIR` as a user runs it: the quick lab writes one page holding
//! every experiment and one SVG per plot, each drawn from the points of its JSON; a
//! replay writes a second report with the differences.

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use wbstack_cli::lab::plots::{svg_polyline_points, svg_texts};

fn wbstack(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_wbstack"))
        .args(args)
        .output()
        .expect("run wbstack");
    assert!(
        out.status.success(),
        "wbstack {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

const VOID: [&str; 6] = ["meta", "br", "img", "hr", "input", "link"];

/// Tags balance: every element opened is closed, in order (void and self-closed ones
/// excepted). Returns the element names in document order.
fn parse_tags(html: &str) -> Vec<String> {
    let mut stack: Vec<String> = Vec::new();
    let mut names = Vec::new();
    let mut rest = html;
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        let j = rest.find('>').expect("an unclosed '<'");
        let tag = &rest[..j];
        rest = &rest[j + 1..];
        if tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack
                .pop()
                .unwrap_or_else(|| panic!("</{name}> closes nothing"));
            assert_eq!(open, name.trim(), "</{name}> closes <{open}>");
            continue;
        }
        let name = tag
            .split_whitespace()
            .next()
            .unwrap_or("")
            .trim_end_matches('/');
        names.push(name.to_string());
        if !tag.ends_with('/') && !VOID.contains(&name) {
            stack.push(name.to_string());
        }
    }
    assert!(stack.is_empty(), "unclosed elements: {stack:?}");
    names
}

/// The SVG of the figure `id` in the page.
fn figure_svg<'a>(html: &'a str, id: &str) -> &'a str {
    let start = html
        .find(&format!("<figure id=\"{id}\">"))
        .unwrap_or_else(|| panic!("no figure {id}"));
    let s = &html[start..];
    let a = s.find("<svg").expect("an svg in the figure");
    let b = s.find("</svg>").expect("the svg ends");
    &s[a..b]
}

fn check_report(dir: &Path, want_plots: &[&str]) -> Value {
    let html = std::fs::read_to_string(dir.join("index.html")).unwrap();
    let names = parse_tags(&html);
    assert!(!names.iter().any(|n| n == "script"), "no script");
    let run: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    let mut ids = Vec::new();
    for s in run["sections"].as_array().unwrap() {
        let exp = s["experiment"].as_str().unwrap();
        assert!(
            html.contains(&format!("<section id=\"{exp}\">")),
            "{exp} named"
        );
        assert!(
            !s["meaning"].as_str().unwrap().is_empty(),
            "{exp}: a meaning"
        );
        assert!(
            !s["commands"].as_array().unwrap().is_empty(),
            "{exp}: commands"
        );
        for p in s["plots"].as_array().unwrap() {
            let id = p["id"].as_str().unwrap().to_string();
            // The plot's own JSON file holds what the run.json holds.
            let file: Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join(format!("{id}.json"))).unwrap(),
            )
            .unwrap();
            assert_eq!(&file, p, "{id}.json");
            let svg = figure_svg(&html, &id);
            let texts = svg_texts(svg);
            for k in ["title", "x_label", "y_label"] {
                let t = p[k].as_str().unwrap();
                assert!(texts.iter().any(|x| x == t), "{id}: {k} '{t}' drawn");
            }
            let kind = p["kind"].as_str().unwrap();
            let series = p["series"].as_array().unwrap();
            assert!(!series.is_empty(), "{id}: series");
            let lines = svg_polyline_points(svg);
            let mut total = 0;
            for s in series {
                let name = s["name"].as_str().unwrap();
                assert!(texts.iter().any(|x| x == name), "{id}: legend names {name}");
                let pts = s["points"].as_array().unwrap();
                assert!(!pts.is_empty(), "{id}: series {name} has points");
                for q in pts {
                    let q = q.as_array().unwrap();
                    assert!(
                        q[0].as_f64().unwrap().is_finite() && q[1].as_f64().unwrap().is_finite()
                    );
                }
                total += pts.len();
                if (kind == "lines" || kind == "percentiles") && pts.len() >= 2 {
                    assert!(
                        lines.contains(&pts.len()),
                        "{id}: a line of {} points for {name} (lines: {lines:?})",
                        pts.len()
                    );
                }
            }
            match kind {
                "points" => assert_eq!(
                    svg.matches("<circle").count(),
                    total + series.len(),
                    "{id}: a dot per point and a legend marker per series"
                ),
                "bars" => assert!(svg.matches("<rect").count() >= total, "{id}"),
                _ => {}
            }
            ids.push(id);
        }
    }
    for want in want_plots {
        assert!(
            ids.iter().any(|i| i.starts_with(want)),
            "plot {want} missing: {ids:?}"
        );
    }
    run
}

#[test]
fn the_quick_lab_report_holds_every_experiment_and_plot() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("report");
    let out = wbstack(&[
        "lab",
        "--runtime",
        "200ms",
        "--report",
        dir.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("about"), "the plan up front: {err}");
    let run = check_report(
        &dir,
        &[
            "plug-rate",
            "plug-write-sizes",
            "expire-first-write",
            "expire-rounds-waited",
            "expire-progress",
            "inflight-iops",
            "wbt-latency-",
            "wbt-late-",
            "wbt-step-",
            "fsync-rate",
            "fsync-per-flush",
            "dirty-levels-",
            "dirty-pauses",
        ],
    );
    let exps: Vec<&str> = run["sections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["experiment"].as_str().unwrap())
        .collect();
    assert_eq!(
        exps,
        ["plug", "expire", "inflight", "wbt", "fsync", "dirty"]
    );
    let info = &run["info"];
    for k in ["git_commit", "kernel_version", "command"] {
        assert!(!info[k].as_str().unwrap().is_empty(), "{k}");
    }
    assert!(info["cpus"].as_u64().unwrap() >= 1);
}

#[test]
fn a_replay_writes_a_second_report_with_the_differences() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("first");
    wbstack(&[
        "lab",
        "inflight",
        "--quick",
        "--runtime",
        "100ms",
        "--report",
        dir.to_str().unwrap(),
    ]);
    let run_json = dir.join("run.json");
    wbstack(&["lab", "--replay", run_json.to_str().unwrap()]);
    let second = dir.join("replay");
    let run = check_report(&second, &["inflight-iops"]);
    assert_eq!(run["info"]["runtime_ms"], 100, "the first run's options");
    let html = std::fs::read_to_string(second.join("index.html")).unwrap();
    assert!(html.contains("Differences from the first run"));
    // Every arm's IOPS appears beside the first run's.
    assert!(html.matches("<td>iops</td>").count() >= 6, "{html}");
    // A second replay goes beside, not over, the first.
    wbstack(&["lab", "--replay", run_json.to_str().unwrap()]);
    assert!(dir.join("replay-2").join("index.html").exists());
}

#[test]
fn a_bad_replay_file_is_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("run.json");
    std::fs::write(&p, "{\"not\": \"a run\"}").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_wbstack"))
        .args(["lab", "--replay", p.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a lab run.json"), "{err}");
    assert!(!err.contains("panicked"));
}
