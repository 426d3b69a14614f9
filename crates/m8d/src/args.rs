//! The clap value parsers every command's flags share, so a bad value is a
//! usage error (exit 2, with what is wrong) at parse time, never a panic or a
//! late, misleading failure: [`seconds`] for every duration flag and
//! [`host_port`] for every address a command connects to.

use std::time::Duration;

/// The longest duration any flag accepts, in seconds: 30 days. Longer values
/// are almost certainly typos, and bounding them keeps every deadline computed
/// from a flag (`now + d`) far from overflowing.
pub const MAX_SECONDS: u64 = 30 * 24 * 3600;

/// Parses a duration given in seconds (`"2"`, `"0.25"`, `"1e-3"`): a finite
/// number, at least 0 and at most [`MAX_SECONDS`].
pub fn seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds"))?;
    if !v.is_finite() {
        return Err(format!("'{s}' is not a finite number of seconds"));
    }
    if v < 0.0 {
        return Err(format!(
            "'{s}' is negative: a duration must be at least 0 seconds"
        ));
    }
    // MAX_SECONDS is far below 2^53, so the conversion to f64 is exact.
    if v > MAX_SECONDS as f64 {
        return Err(format!(
            "'{s}' seconds is too long: at most {MAX_SECONDS} (30 days)"
        ));
    }
    // Cannot fail after the checks above; mapped rather than unwrapped anyway.
    Duration::try_from_secs_f64(v).map_err(|e| format!("'{s}': {e}"))
}

/// Parses an address to connect to: `host:port` with a port from 1 to 65535,
/// where host is an IPv4 address, a name, or an IPv6 address in brackets
/// (`[::1]:29400`). Returns it unchanged (names are resolved when connecting).
pub fn host_port(s: &str) -> Result<String, String> {
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(format!(
            "'{s}' has no port: expected host:port, e.g. 127.0.0.1:29400"
        ));
    };
    if host.is_empty() {
        return Err(format!(
            "'{s}' has no host: expected host:port, e.g. 127.0.0.1:29400"
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => {
            return Err(format!(
                "'{s}' has a bad port '{port}': expected a number from 1 to 65535"
            ));
        }
    }
    if let Some(inner) = host.strip_prefix('[') {
        let ok = inner
            .strip_suffix(']')
            .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok());
        if !ok {
            return Err(format!("'{s}' has a bad IPv6 address: expected [ip]:port"));
        }
    } else if host.contains(':') {
        return Err(format!(
            "'{s}' is ambiguous: write an IPv6 address in brackets, e.g. [::1]:29400"
        ));
    } else if host.chars().any(|c| c.is_whitespace() || c == '/') {
        return Err(format!("'{s}' has a bad host '{host}'"));
    }
    Ok(s.to_owned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn seconds_accepts_finite_bounded_values_only() {
        assert_eq!(seconds("2").unwrap(), Duration::from_secs(2));
        assert_eq!(seconds("0.25").unwrap(), Duration::from_millis(250));
        assert_eq!(seconds("0").unwrap(), Duration::ZERO);
        assert_eq!(
            seconds(&MAX_SECONDS.to_string()).unwrap(),
            Duration::from_secs(MAX_SECONDS)
        );
        for bad in ["1e30", "-1", "-0.5", "nan", "NaN", "inf", "-inf", "", "abc", "1s"] {
            let e = seconds(bad).unwrap_err();
            assert!(e.contains(bad), "{bad}: {e}");
        }
        assert!(seconds("1e30").unwrap_err().contains("too long"));
        assert!(seconds("-1").unwrap_err().contains("negative"));
        assert!(seconds("nan").unwrap_err().contains("finite"));
    }

    #[test]
    fn host_port_needs_a_host_and_a_valid_port() {
        for good in [
            "127.0.0.1:29400",
            "localhost:1",
            "[::1]:65535",
            "store.example:80",
        ] {
            assert_eq!(host_port(good).unwrap(), good);
        }
        assert!(host_port("127.0.0.1").unwrap_err().contains("no port"));
        assert!(host_port("127.0.0.1:abc").unwrap_err().contains("bad port"));
        assert!(host_port("127.0.0.1:99999").unwrap_err().contains("bad port"));
        assert!(host_port("127.0.0.1:0").unwrap_err().contains("bad port"));
        assert!(host_port(":29400").unwrap_err().contains("no host"));
        assert!(host_port("::1:29400").unwrap_err().contains("brackets"));
        assert!(host_port("[zz]:29400").unwrap_err().contains("IPv6"));
    }
}
