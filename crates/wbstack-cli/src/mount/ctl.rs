//! `wbstack ctl DIR [knob[=value]]`: the control directory without knowing its path.

use std::io::Write;
use std::path::Path;

/// syncfs of the volume mounted on `dir`: a write to its control directory's `sync`
/// (the kernel sends sync(2) and syncfs(2) to no FUSE daemon). Returns once every
/// dirty page is written back and the journal committed, or with the error syncfs
/// would have returned (a writeback error since the last sync, a failed journal).
pub fn sync(dir: &Path) -> Result<(), String> {
    let file = dir.join(".wbstack/sync");
    if !file.is_file() {
        return Err(format!("{}: not a wbstack mount", dir.display()));
    }
    let mut f = match std::fs::OpenOptions::new().write(true).open(&file) {
        Ok(f) => f,
        // A read-only mount (`-o ro`) has nothing to write back.
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", file.display())),
    };
    f.write_all(b"1\n")
        .map_err(|e| format!("{}: {e}", dir.display()))
}

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
