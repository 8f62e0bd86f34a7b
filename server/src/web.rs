//! The web view: a handful of static files compiled into the binary (no network at run time,
//! no build step), served at `/` to browsers and under `/ui/`. The page reads the same HTTP
//! API and SQL endpoint as the CLI, with the token the user signs in with, so it sees exactly
//! what that token may see.
//!
//! `server/web/` holds the files; `server/web/vendor/` the third-party ones, rebuilt by
//! `scripts/vendor-web.sh`.

use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::OnceLock;

/// A file of the web view.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const INDEX: Asset = Asset {
    name: "index.html",
    content_type: "text/html; charset=utf-8",
    body: include_bytes!("../web/index.html"),
};

/// What `/ui/{file}` serves.
const ASSETS: &[Asset] = &[
    INDEX,
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../web/app.js"),
    },
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../web/app.css"),
    },
    Asset {
        name: "uPlot.iife.min.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../web/vendor/uPlot.iife.min.js"),
    },
    Asset {
        name: "uPlot.min.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../web/vendor/uPlot.min.css"),
    },
    Asset {
        name: "favicon.svg",
        content_type: "image/svg+xml",
        body: include_bytes!("../web/favicon.svg"),
    },
];

/// The page may load scripts, styles and data from this server only; no inline script runs
/// (a job name with markup in it stays text even if a view forgot to escape it), and no other
/// site may frame it.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; \
                   base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Whether a request for `/` comes from a browser (which asks for HTML first) rather than
/// an API client (curl's `*/*`, `application/json`).
pub fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|accept| {
            accept
                .split(',')
                .any(|part| part.split(';').next().map(str::trim) == Some("text/html"))
        })
}

/// The page itself, for `/`.
pub fn index(headers: &HeaderMap) -> Response {
    serve(&INDEX, headers)
}

pub async fn asset(Path(file): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().find(|a| a.name == file) {
        Some(asset) => serve(asset, &headers),
        None => crate::error::ApiError::new(
            StatusCode::NOT_FOUND,
            crate::ErrorCode::NotFound,
            format!(
                "no file /ui/{file}; the web view's files are {}",
                ASSETS.iter().map(|a| a.name).collect::<Vec<_>>().join(", ")
            ),
        )
        .into_response(),
    }
}

/// An asset with a strong validator: the browser asks again each time (`no-cache`) and gets
/// `304 Not Modified` until the binary changes.
fn serve(asset: &Asset, headers: &HeaderMap) -> Response {
    let etag = etag(asset);
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let common = [
        (header::ETAG, HeaderValue::from_str(etag).ok()),
        (
            header::CACHE_CONTROL,
            Some(HeaderValue::from_static("no-cache")),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            Some(HeaderValue::from_static("nosniff")),
        ),
        (
            header::CONTENT_SECURITY_POLICY,
            Some(HeaderValue::from_static(CSP)),
        ),
        (
            header::REFERRER_POLICY,
            Some(HeaderValue::from_static("no-referrer")),
        ),
    ];
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, asset.content_type)], asset.body).into_response()
    };
    for (name, value) in common {
        if let Some(value) = value {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// The asset's ETag: a hash of its bytes, computed once.
fn etag(asset: &Asset) -> &'static str {
    static TAGS: OnceLock<Vec<String>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        ASSETS
            .iter()
            .map(|a| format!("\"{}\"", &blake3::hash(a.body).to_hex()[..16]))
            .collect()
    });
    ASSETS
        .iter()
        .position(|a| a.name == asset.name)
        .map_or("\"0\"", |i| tags[i].as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn browsers_get_the_page_and_api_clients_the_index() {
        let with = |accept: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                header::ACCEPT,
                HeaderValue::from_str(accept).expect("ascii"),
            );
            wants_html(&h)
        };
        assert!(with(
            "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
        ));
        assert!(with("application/xhtml+xml, text/html;q=0.9"));
        assert!(!with("*/*"), "curl");
        assert!(!with("application/json"));
        assert!(!with("text/htmlx"));
        assert!(!wants_html(&HeaderMap::new()));
    }

    #[test]
    fn an_unchanged_asset_is_not_sent_again() {
        let app = &ASSETS[1];
        let first = serve(app, &HeaderMap::new());
        assert_eq!(first.status(), StatusCode::OK);
        let tag = first.headers()[header::ETAG].clone();
        assert!(
            first.headers()[header::CONTENT_SECURITY_POLICY]
                .to_str()
                .expect("ascii")
                .contains("script-src 'self'")
        );
        let mut again = HeaderMap::new();
        again.insert(header::IF_NONE_MATCH, tag);
        assert_eq!(serve(app, &again).status(), StatusCode::NOT_MODIFIED);
        // Another file's tag is not this one's.
        let mut other = HeaderMap::new();
        other.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"x\""));
        assert_eq!(serve(app, &other).status(), StatusCode::OK);
    }

    #[test]
    fn every_asset_the_page_names_is_served() {
        let page = std::str::from_utf8(INDEX.body).expect("utf-8");
        for part in page.split("/ui/").skip(1) {
            let name = part.split('"').next().unwrap_or_default();
            assert!(
                ASSETS.iter().any(|a| a.name == name),
                "index.html loads /ui/{name}, which is not served"
            );
        }
    }
}
