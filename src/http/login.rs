//! The dashboard's login: a form that takes a token and sets it as an
//! HttpOnly, SameSite=Strict cookie (no JavaScript anywhere). The cookie is
//! accepted for reads only ([`super::auth`]), so a page elsewhere can never
//! use it to change anything; the API's writes need the bearer header.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use serde::Deserialize;

use super::AppState;
use super::auth::{COOKIE, Principal, lookup_token};
use super::error::ApiError;

#[derive(Deserialize)]
pub struct LoginForm {
    token: String,
}

fn page(message: &str) -> Html<String> {
    Html(format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>treewarden: sign in</title>
<style>body{{font-family:system-ui,sans-serif;max-width:32rem;margin:4rem auto}}input{{width:100%;font-family:monospace}}</style>
</head><body>
<h1>treewarden</h1>
<p>Reads need a token (<code>treewarden token create --scope read</code>). It is kept in an HttpOnly cookie for this site only.</p>
<p role="alert">{message}</p>
<form method="post" action="/login">
<label for="token">Token</label>
<input id="token" name="token" type="password" autocomplete="off" required>
<button type="submit">Sign in</button>
</form>
</body></html>
"#
    ))
}

/// `GET /login`: the form.
pub async fn form() -> Html<String> {
    page("")
}

/// `POST /login`: a live token sets the cookie and goes to the dashboard;
/// anything else is 401 with the form again.
pub async fn submit(
    State(s): State<AppState>,
    axum::Form(f): axum::Form<LoginForm>,
) -> Result<Response, ApiError> {
    let token = f.token.trim().to_string();
    match lookup_token(&s, &token).await? {
        Some(Principal::Token { .. }) if token.bytes().all(|b| b.is_ascii_alphanumeric()) => {
            let cookie = format!("{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/");
            Ok((
                StatusCode::SEE_OTHER,
                [(header::SET_COOKIE, cookie), (header::LOCATION, "/".into())],
            )
                .into_response())
        }
        _ => Ok((
            StatusCode::UNAUTHORIZED,
            page("That token is unknown or revoked."),
        )
            .into_response()),
    }
}
