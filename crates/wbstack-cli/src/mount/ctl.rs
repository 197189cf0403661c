//! `wbstack ctl DIR [knob[=value]]`: the control directory without knowing its path.

use std::path::Path;

/// What a ctl invocation printed.
pub fn ctl(dir: &Path, arg: Option<&str>) -> Result<String, String> {
    let base = dir.join(".wbstack");
    if !base.is_dir() {
        return Err(format!("{}: not a wbstack mount", dir.display()));
    }
    let read = |k: &str| {
        std::fs::read_to_string(base.join(k)).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!(
                "{k}: no such knob (knobs: {})",
                wbstack::fs::tunables::TUNABLES.join(", ")
            ),
            _ => format!("{k}: {e}"),
        })
    };
    match arg {
        None => {
            let mut out = String::new();
            for k in wbstack::fs::tunables::TUNABLES {
                out.push_str(&format!("{k}={}\n", read(k)?.trim()));
            }
            Ok(out)
        }
        Some(a) => match a.split_once('=') {
            None => read(a),
            Some((k, v)) => {
                if !base.join(k).exists() {
                    return Err(read(k)
                        .err()
                        .unwrap_or_else(|| format!("{k}: no such knob")));
                }
                std::fs::write(base.join(k), format!("{v}\n")).map_err(|e| {
                    match e.raw_os_error() {
                        Some(libc::EINVAL) => format!(
                            "{k}={v}: invalid value (kept {})",
                            read(k).unwrap_or_default().trim()
                        ),
                        Some(libc::EACCES) => {
                            format!("{k}: only the mount's owner and root may set it")
                        }
                        _ => format!("{k}: {e}"),
                    }
                })?;
                Ok(format!("{k}={}\n", read(k)?.trim()))
            }
        },
    }
}
