//! Parsing of device spec strings: `KIND[,key=value]...`.

use std::collections::BTreeMap;

/// A device spec that could not be understood, with the reason in plain words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad device spec '{spec}': {reason}")]
pub struct SpecError {
    pub spec: String,
    pub reason: String,
}

impl SpecError {
    pub fn new(spec: &str, reason: impl Into<String>) -> SpecError {
        SpecError {
            spec: spec.to_string(),
            reason: reason.into(),
        }
    }
}

/// The first token of every spec, up to the first `,` or `:`: `null`, `sim` (of
/// `sim:ssd`, `sim:hdd`) and `file` (of `file:PATH`).
const SPEC_KINDS: [&str; 3] = ["null", "sim", "file"];

/// The device kind `s` names (`"null"`, `"sim"` or `"file"`) when it is a spec, None
/// when it is not. The kind must be the whole first token: a tool that also takes bare
/// image paths decides with this, and a prefix test would take `nullimage.img` or
/// `simple.img` for a spec.
pub fn spec_kind(s: &str) -> Option<&'static str> {
    let head = s.trim().split([',', ':']).next().unwrap_or_default();
    SPEC_KINDS.iter().copied().find(|k| *k == head)
}

/// A parsed spec: the kind (`null`, `sim:ssd`, `sim:hdd`, `file`), for `file` the path,
/// and the options. Every option must be consumed by the device (`finish`), so a typo
/// is an error rather than silently ignored.
#[derive(Debug, Clone)]
pub struct DeviceSpec {
    pub raw: String,
    pub kind: String,
    pub path: Option<String>,
    opts: BTreeMap<String, String>,
    used: std::cell::RefCell<std::collections::BTreeSet<String>>,
}

impl DeviceSpec {
    pub fn parse(spec: &str) -> Result<DeviceSpec, SpecError> {
        let spec_t = spec.trim();
        if spec_t.is_empty() {
            return Err(SpecError::new(spec, "empty spec"));
        }
        let mut parts = spec_t.split(',');
        let head = parts.next().unwrap_or_default();
        let (kind, path) = if let Some(p) = head.strip_prefix("file:") {
            if p.is_empty() {
                return Err(SpecError::new(
                    spec,
                    "file: needs a path, as in file:/tmp/disk.img",
                ));
            }
            ("file".to_string(), Some(p.to_string()))
        } else {
            (head.to_string(), None)
        };
        let mut opts = BTreeMap::new();
        for p in parts {
            let p = p.trim();
            if p.is_empty() {
                continue;
            }
            let (k, v) = match p.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None => (p, "1"),
            };
            if opts.insert(k.to_string(), v.to_string()).is_some() {
                return Err(SpecError::new(spec, format!("option '{k}' given twice")));
            }
        }
        Ok(DeviceSpec {
            raw: spec_t.to_string(),
            kind,
            path,
            opts,
            used: Default::default(),
        })
    }

    fn take(&self, key: &str) -> Option<&str> {
        self.used.borrow_mut().insert(key.to_string());
        self.opts.get(key).map(|s| s.as_str())
    }

    pub fn err(&self, reason: impl Into<String>) -> SpecError {
        SpecError::new(&self.raw, reason)
    }

    pub fn has(&self, key: &str) -> bool {
        self.take(key).is_some()
    }

    pub fn str_opt(&self, key: &str) -> Option<String> {
        self.take(key).map(|s| s.to_string())
    }

    pub fn size(&self, key: &str, default: u64) -> Result<u64, SpecError> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => parse_size(v).map_err(|e| self.err(format!("{key}={v}: {e}"))),
        }
    }

    pub fn duration_ns(&self, key: &str, default: u64) -> Result<u64, SpecError> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => parse_duration(v).map_err(|e| self.err(format!("{key}={v}: {e}"))),
        }
    }

    pub fn u64(&self, key: &str, default: u64) -> Result<u64, SpecError> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => parse_size(v).map_err(|e| self.err(format!("{key}={v}: {e}"))),
        }
    }

    pub fn f64(&self, key: &str, default: f64) -> Result<f64, SpecError> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => v
                .parse::<f64>()
                .map_err(|_| self.err(format!("{key}={v}: not a number"))),
        }
    }

    pub fn bool(&self, key: &str, default: bool) -> Result<bool, SpecError> {
        match self.take(key) {
            None => Ok(default),
            Some("1" | "on" | "yes" | "true") => Ok(true),
            Some("0" | "off" | "no" | "false") => Ok(false),
            Some(v) => Err(self.err(format!("{key}={v}: expected 0/1, on/off"))),
        }
    }

    /// Fail on any option the device did not read.
    pub fn finish(&self, known: &str) -> Result<(), SpecError> {
        let used = self.used.borrow();
        let unknown: Vec<&String> = self.opts.keys().filter(|k| !used.contains(*k)).collect();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(self.err(format!(
                "unknown option{} {} for {} (known: {known})",
                if unknown.len() > 1 { "s" } else { "" },
                unknown
                    .iter()
                    .map(|s| format!("'{s}'"))
                    .collect::<Vec<_>>()
                    .join(", "),
                self.kind
            )))
        }
    }
}

/// Parse a size with an optional binary suffix: `4096`, `4k`, `400M`, `1.5G`, `100T`.
/// Suffixes are powers of 1024 (as in fio); a trailing `B`/`iB` is allowed.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .unwrap_or(t);
    let t = t.strip_suffix(['B', 'b']).unwrap_or(t);
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_lowercase() {
                'k' => 1 << 10,
                'm' => 1 << 20,
                'g' => 1 << 30,
                't' => 1 << 40,
                'p' => 1 << 50,
                _ => return Err(format!("unknown size suffix '{c}' (use k, M, G, T or P)")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    if num.is_empty() {
        return Err("missing number".into());
    }
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| "size too large".to_string());
    }
    match num.parse::<f64>() {
        Ok(f) if f >= 0.0 && f.is_finite() => {
            let v = f * mult as f64;
            if v > u64::MAX as f64 {
                Err("size too large".into())
            } else {
                Ok(v.round() as u64)
            }
        }
        _ => Err(format!("'{s}' is not a size")),
    }
}

/// Parse a duration into nanoseconds: `80us`, `2ms`, `1.5s`, `500ns`; a bare number is
/// nanoseconds.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult = match unit {
        "" | "ns" => 1.0,
        "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return Err(format!("unknown time unit '{unit}' (use ns, us, ms or s)")),
    };
    match num.parse::<f64>() {
        Ok(f) if f >= 0.0 && f.is_finite() => Ok((f * mult).round() as u64),
        _ => Err(format!("'{s}' is not a duration")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("400M").unwrap(), 400 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("100T").unwrap(), 100 << 40);
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert!(parse_size("12q").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("-1").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("80us").unwrap(), 80_000);
        assert_eq!(parse_duration("2ms").unwrap(), 2_000_000);
        assert_eq!(parse_duration("1.5s").unwrap(), 1_500_000_000);
        assert_eq!(parse_duration("500").unwrap(), 500);
        assert!(parse_duration("5m").is_err());
    }

    #[test]
    fn spec_options_and_unknowns() {
        let s = DeviceSpec::parse("sim:ssd,iops=27000,bw=400M,lat=80us").unwrap();
        assert_eq!(s.kind, "sim:ssd");
        assert_eq!(s.u64("iops", 0).unwrap(), 27000);
        assert_eq!(s.size("bw", 0).unwrap(), 400 << 20);
        assert_eq!(s.duration_ns("lat", 0).unwrap(), 80_000);
        s.finish("iops, bw, lat").unwrap();

        let s = DeviceSpec::parse("null,bogus=1").unwrap();
        let e = s.finish("size").unwrap_err();
        assert!(e.to_string().contains("'bogus'"), "{e}");

        let s = DeviceSpec::parse("file:/tmp/x.img,size=1G").unwrap();
        assert_eq!(s.kind, "file");
        assert_eq!(s.path.as_deref(), Some("/tmp/x.img"));
        assert!(DeviceSpec::parse("file:").is_err());
        assert!(DeviceSpec::parse("null,a=1,a=2").is_err());
    }

    #[test]
    fn a_spec_kind_is_the_whole_first_token() {
        for (s, kind) in [
            ("null", Some("null")),
            ("null,size=1G", Some("null")),
            ("sim:ssd", Some("sim")),
            ("sim:hdd,seed=2", Some("sim")),
            ("file:/tmp/x.img", Some("file")),
            ("file:null.img,size=1G", Some("file")),
            ("nullimage.img", None),
            ("null.img", None),
            ("nullx,size=1G", None),
            ("simple.img", None),
            ("files/disk.img", None),
            ("/tmp/null", None),
            ("", None),
        ] {
            assert_eq!(spec_kind(s), kind, "{s:?}");
        }
    }
}
