//! The OpenAPI document's frame: its info, the schemas it names, the
//! bearer scheme. The paths come from the routes (`utoipa_axum::routes!`
//! in http/mod.rs).

use utoipa::OpenApi;

use super::bodies::{
    ErrorBody, Health, KillResponse, LimitsBody, PhaseJson, Readiness, Recovery, ResolveBody,
    ShutdownAnswer, SpawnBody,
};
use crate::ledger::{
    AuthorizationRow, EventRow, ExitRecord, IdentityRecord, KillTarget, MemberRow, ObservationRow,
    OwnerRow, SignalRow, TreeDetail, TreeRow, TreeState,
};

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI document of this API.
#[derive(OpenApi)]
#[openapi(
    info(title = "treewarden", description = "Custody of process trees: spawn, inspect, kill, audit."),
    components(schemas(ErrorBody, super::error::ErrorCode, super::stream::StreamEvent, SpawnBody, crate::ledger::Requester, LimitsBody, ResolveBody, KillResponse, PhaseJson, Health, Recovery, Readiness, ShutdownAnswer,
        TreeRow, TreeDetail, TreeState, OwnerRow, ExitRecord, MemberRow, ObservationRow,
        SignalRow, AuthorizationRow, KillTarget, IdentityRecord, EventRow)),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;
