//! What a request must pass before a handler sees it, each refusal in the
//! dialect's error shape:
//!
//! 1. **Host** (403): when the server is bound to loopback, the `Host` header
//!    must name a loopback host (`localhost`, `*.localhost`, `127.0.0.0/8`,
//!    `[::1]`, any port) or one given by `--allowed-host`. A web page that
//!    rebinds its own DNS name to 127.0.0.1 still sends that name, so it cannot
//!    reach a keyless server through the victim's browser.
//! 2. **API key** (401) when one is set.
//! 3. **Content type** (415): a POST must say `application/json` (or
//!    `application/*+json`). Browsers send `text/plain`, form and multipart
//!    bodies cross-origin without a CORS preflight; a JSON type needs one, which
//!    the server does not grant unless `--cors`.
//! 4. **Body** (413 over the cap, 408 past the deadline, 400 when its framing is
//!    broken, e.g. a chunk size that overflows): read here, with the cap applied
//!    as it streams in, so no handler waits on a slow body or holds more than
//!    the cap.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Body as _;

use crate::dialect::{Dialect, ErrorKind};
use crate::openai::{Kind, OpenAi};
use crate::state::{session_keys, AppState, ServerConfig, ROUTE, SESSION_KEYS};

/// The checks above, CORS headers and preflight, and request counting.
pub(crate) async fn guard(
    State(st): State<Arc<AppState>>,
    req: HttpRequest,
    next: Next,
) -> Response {
    let path = req.uri().path().to_string();
    let keys = session_keys(req.headers());
    let d = dialect_for_path(&path);
    let refused = |status: StatusCode, msg: &str, kind: ErrorKind| d.error(status, msg, kind);
    let mut r = if let Err(host) = host_allowed(&st.cfg, req.headers()) {
        refused(
            StatusCode::FORBIDDEN,
            &format!(
                "Host {host:?} is not allowed: this server listens on loopback and answers \
                 only loopback names (start it with --allowed-host {host} to allow this one)"
            ),
            ErrorKind::Forbidden,
        )
    } else if req.method() == Method::OPTIONS {
        StatusCode::NO_CONTENT.into_response()
    } else if !authorized(&st.cfg, req.headers()) {
        refused(
            StatusCode::UNAUTHORIZED,
            "invalid or missing API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
            ErrorKind::Authentication,
        )
    } else if req.method() == Method::POST && !json_content(req.headers()) {
        refused(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the request body must be JSON: send `Content-Type: application/json`",
            ErrorKind::InvalidRequest,
        )
    } else if req.method() == Method::POST {
        match read_body(&st, req).await {
            Ok(req) => {
                ROUTE
                    .scope(path.clone(), SESSION_KEYS.scope(keys, next.run(req)))
                    .await
            }
            Err((status, msg)) => refused(status, &msg, ErrorKind::InvalidRequest),
        }
    } else {
        ROUTE.scope(path.clone(), next.run(req)).await
    };
    if st.cfg.cors {
        add_cors(r.headers_mut());
    }
    st.metrics.request(&path, r.status().as_u16());
    r
}

/// `Ok` when the Host may be served, else the host name refused.
fn host_allowed(cfg: &ServerConfig, h: &HeaderMap) -> Result<(), String> {
    let (Some(allowed), Some(host)) = (&cfg.allowed_hosts, h.get(header::HOST)) else {
        // Not bound to loopback, or no Host (not a browser).
        return Ok(());
    };
    let host = host.to_str().map_err(|_| "(not ASCII)".to_string())?;
    let name = host_name(host);
    let loopback = name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
        || name
            .strip_prefix('[')
            .and_then(|n| n.strip_suffix(']'))
            .and_then(|n| n.parse::<Ipv6Addr>().ok())
            .is_some_and(|ip| ip.is_loopback());
    if loopback || allowed.iter().any(|a| host_name(a) == name) {
        Ok(())
    } else {
        Err(name)
    }
}

/// A Host value's name: lowercase, without the port and a trailing dot
/// (`[::1]` keeps its brackets).
fn host_name(host: &str) -> String {
    let host = host.trim();
    let name = match host.rfind(':') {
        // A port after a name or an IPv4 address, or after a bracketed IPv6.
        Some(i) if !host[..i].contains(':') || host[..i].ends_with(']') => &host[..i],
        _ => host,
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// Whether the body is declared JSON: `application/json` or
/// `application/*+json`, any parameters.
fn json_content(h: &HeaderMap) -> bool {
    let Some(ct) = h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let mime = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

pub(crate) fn authorized(cfg: &ServerConfig, h: &HeaderMap) -> bool {
    let Some(key) = &cfg.api_key else {
        return true;
    };
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = h.get("x-api-key").and_then(|v| v.to_str().ok());
    bearer == Some(key.as_str()) || x_api_key == Some(key.as_str())
}

/// Reads the whole body within the cap and the deadline; the request comes
/// back with it in memory.
async fn read_body(st: &AppState, req: HttpRequest) -> Result<HttpRequest, (StatusCode, String)> {
    let (limit, deadline) = (st.max_body_bytes, st.cfg.body_timeout);
    let too_large = || {
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is larger than {limit} bytes (--max-body-bytes; the default \
                 follows the context size)"
            ),
        )
    };
    let (parts, body) = req.into_parts();
    if body.size_hint().lower() > limit as u64 {
        return Err(too_large());
    }
    match tokio::time::timeout(deadline, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => Ok(HttpRequest::from_parts(
            parts,
            Body::from(collected.to_bytes()),
        )),
        Ok(Err(e)) if e.is::<LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) => {
            let mut msg = format!("could not read the request body: {e}");
            let mut source = e.source();
            while let Some(s) = source {
                msg.push_str(&format!(": {s}"));
                source = s.source();
            }
            Err((StatusCode::BAD_REQUEST, msg))
        }
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s (--body-timeout)",
                deadline.as_secs_f64()
            ),
        )),
    }
}

fn add_cors(h: &mut HeaderMap) {
    h.insert("access-control-allow-origin", HeaderValue::from_static("*"));
    h.insert(
        "access-control-allow-methods",
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    h.insert(
        "access-control-allow-headers",
        HeaderValue::from_static("*"),
    );
}

/// The dialect whose error shape answers a request to `path` that no handler
/// parsed (authentication, body size, unknown routes).
pub(crate) fn dialect_for_path(path: &str) -> Arc<dyn Dialect> {
    if path.starts_with("/v1/messages") {
        return Arc::new(crate::anthropic::Anthropic::default());
    }
    Arc::new(OpenAi::new(Kind::Chat))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn loopback_hosts_and_allowed_names() {
        let cfg = ServerConfig {
            allowed_hosts: Some(vec!["box.lan".into()]),
            ..ServerConfig::default()
        };
        let ok = |host: &str| host_allowed(&cfg, &headers(&[("host", host)])).is_ok();
        for host in [
            "127.0.0.1:8000",
            "127.0.0.1",
            "127.1.2.3:1",
            "localhost:8000",
            "LOCALHOST.",
            "app.localhost:9",
            "[::1]:8000",
            "[::1]",
            "box.lan:8000",
            "Box.Lan",
        ] {
            assert!(ok(host), "{host}");
        }
        for host in [
            "evil.example:8000",
            "evil.example",
            "localhost.evil.example",
            "128.0.0.1:8000",
            "[::2]:8000",
            "10.0.0.1",
            "box.lan.evil",
        ] {
            assert!(!ok(host), "{host}");
        }
        assert_eq!(
            host_allowed(&cfg, &headers(&[("host", "Evil.Example.:80")])),
            Err("evil.example".into())
        );
        // No Host header (not a browser), or not bound to loopback: no check.
        assert!(host_allowed(&cfg, &HeaderMap::new()).is_ok());
        let open = ServerConfig {
            allowed_hosts: None,
            ..ServerConfig::default()
        };
        assert!(host_allowed(&open, &headers(&[("host", "evil.example")])).is_ok());
    }

    #[test]
    fn only_json_bodies() {
        let ct = |v: &str| json_content(&headers(&[("content-type", v)]));
        assert!(ct("application/json"));
        assert!(ct("Application/JSON; charset=utf-8"));
        assert!(ct("application/vnd.api+json"));
        assert!(!ct("text/plain"));
        assert!(!ct("application/x-www-form-urlencoded"));
        assert!(!ct("multipart/form-data; boundary=x"));
        assert!(!ct("text/json"));
        assert!(!json_content(&HeaderMap::new()));
    }
}
