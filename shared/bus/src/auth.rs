//! NATS authentication: who may connect and what each connection may publish or receive.
//!
//! The platform's own services (gateway, scheduler, dataplane) are users of the server's
//! configuration, each with its own password. Runtime Hosts and self-hosted Workers run on
//! customers' machines: they connect with the credential they already hold (a host token or a
//! worker token as the password) and the server asks the scheduler through the **auth callout**
//! (`$SYS.REQ.USER.AUTH`) whether to let them in. The scheduler checks the token in
//! PostgreSQL and answers with a user JWT, signed by the callout issuer key, whose permissions
//! name only that host's (or worker's) own subjects ([`host_permissions`],
//! [`worker_permissions`]). A host cannot publish another host's events, renew another host's
//! leases, read another host's control messages, claim for another host or decide approvals.
//!
//! This module holds the pure parts: nkeys encoding, JWT signing with ring's Ed25519, the
//! server configuration for a generated [`Setup`] and the permission sets.

use base64::Engine as _;
use ring::signature::KeyPair as _;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The subject the server sends authorization requests to.
pub const CALLOUT_SUBJECT: &str = "$SYS.REQ.USER.AUTH";
/// The services that connect with a password from the server configuration.
pub const SERVICE_USERS: [&str; 3] = ["gateway", "scheduler", "dataplane"];

const PREFIX_SEED: u8 = 18 << 3;
const PREFIX_ACCOUNT: u8 = 0;
const PREFIX_USER: u8 = 20 << 3;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("not a valid account seed (expected the 58 characters of an `SA...` nkey seed)")]
    BadSeed,
    #[error("authorization request: {0}")]
    BadRequest(String),
}

/// An Ed25519 account key in nkeys form.
pub struct AccountKey {
    seed: [u8; 32],
    pair: ring::signature::Ed25519KeyPair,
}

impl Clone for AccountKey {
    fn clone(&self) -> AccountKey {
        AccountKey::from_raw(self.seed)
    }
}

impl std::fmt::Debug for AccountKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccountKey")
            .field("public", &self.public_key())
            .finish_non_exhaustive()
    }
}

impl AccountKey {
    pub fn generate() -> AccountKey {
        use ring::rand::SecureRandom as _;
        let mut seed = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut seed)
            .expect("the system's random source");
        Self::from_raw(seed)
    }

    fn from_raw(seed: [u8; 32]) -> AccountKey {
        let pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&seed)
            .expect("any 32 bytes are an Ed25519 seed");
        AccountKey { seed, pair }
    }

    /// Parses an `SA...` seed (as `nsc` and `nk` print it).
    pub fn from_seed(text: &str) -> Result<AccountKey, AuthError> {
        let raw = base32_decode(text.trim()).ok_or(AuthError::BadSeed)?;
        if raw.len() != 36 || crc16(&raw[..34]) != u16::from_le_bytes([raw[34], raw[35]]) {
            return Err(AuthError::BadSeed);
        }
        let (b1, b2) = (raw[0], raw[1]);
        let kind = ((b1 & 7) << 5) | ((b2 & 248) >> 3);
        if b1 & 248 != PREFIX_SEED || kind != PREFIX_ACCOUNT {
            return Err(AuthError::BadSeed);
        }
        let mut seed = [0u8; 32];
        seed.copy_from_slice(&raw[2..34]);
        Ok(Self::from_raw(seed))
    }

    pub fn seed(&self) -> String {
        let mut raw = vec![
            PREFIX_SEED | (PREFIX_ACCOUNT >> 5),
            (PREFIX_ACCOUNT & 31) << 3,
        ];
        raw.extend_from_slice(&self.seed);
        let crc = crc16(&raw);
        raw.extend_from_slice(&crc.to_le_bytes());
        base32_encode(&raw)
    }

    /// The `A...` public key the server configuration names as the callout issuer.
    pub fn public_key(&self) -> String {
        encode_public(PREFIX_ACCOUNT, self.pair.public_key().as_ref())
    }

    /// A JWT (`ed25519-nkey`, as nats-io/jwt v2 writes them) of `claims`, issued by this key.
    fn sign_jwt(&self, mut claims: serde_json::Value) -> String {
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        claims["iss"] = json!(self.public_key());
        claims["iat"] = json!(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        );
        let digest = ring::digest::digest(&ring::digest::SHA256, claims.to_string().as_bytes());
        claims["jti"] = json!(base32_encode(digest.as_ref()));
        let header = b64.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
        let payload = b64.encode(claims.to_string());
        let signing_input = format!("{header}.{payload}");
        let sig = self.pair.sign(signing_input.as_bytes());
        format!("{signing_input}.{}", b64.encode(sig.as_ref()))
    }
}

fn encode_public(prefix: u8, key: &[u8]) -> String {
    let mut raw = vec![prefix];
    raw.extend_from_slice(key);
    let crc = crc16(&raw);
    raw.extend_from_slice(&crc.to_le_bytes());
    base32_encode(&raw)
}

/// Is `key` a well-formed `U...` user public key?
pub fn is_user_key(key: &str) -> bool {
    base32_decode(key).is_some_and(|raw| {
        raw.len() == 35
            && raw[0] == PREFIX_USER
            && crc16(&raw[..33]) == u16::from_le_bytes([raw[33], raw[34]])
    })
}

/// CRC-16/XMODEM, as nkeys checksums its keys.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

const B32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

fn base32_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len() * 8 / 5 + 1);
    let (mut buf, mut bits) = (0u32, 0u32);
    for &b in data {
        buf = (buf << 8) | b as u32;
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(B32[((buf >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(B32[((buf << (5 - bits)) & 31) as usize] as char);
    }
    out
}

fn base32_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 5 / 8);
    let (mut buf, mut bits) = (0u32, 0u32);
    for c in text.bytes() {
        let v = B32.iter().position(|&x| x == c)? as u32;
        buf = (buf << 5) | v;
        bits += 5;
        if bits >= 8 {
            bits -= 8;
            out.push((buf >> bits) as u8);
        }
    }
    Some(out)
}

/// Which subjects a connection may publish and subscribe to.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
}

/// The inbox prefix a host uses, so that no other client can read its replies.
pub fn host_inbox(host_id: &str) -> String {
    format!("_INBOX_host_{host_id}")
}

/// The inbox prefix a worker uses: derived from its token, which only it and the callout know
/// (a Worker learns its id only when it registers).
pub fn worker_inbox(token: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let hex: String = digest.as_ref()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("_INBOX_worker_{hex}")
}

/// What a Runtime Host of `workspace_id` with id `host_id` may do on the bus: its own
/// registration, claims, events, approval requests, leases and presence, its own control
/// consumer, the work nudges of its workspace's pools, and the offers made to it.
pub fn host_permissions(workspace_id: &str, host_id: &str) -> Permissions {
    use crate::{BUCKET_LEASES, BUCKET_PRESENCE, STREAM_CONTROL, STREAM_EVENTS, subjects};
    let consumer = format!("host-{host_id}");
    let inbox = host_inbox(host_id);
    Permissions {
        publish: vec![
            subjects::host_register(host_id),
            subjects::host_claim(host_id),
            format!("agentscope.events.{host_id}.*"),
            format!("agentscope.approvals.requested.host.{host_id}.*"),
            format!("agentscope.pool.{workspace_id}.*.work"),
            format!("$KV.{BUCKET_LEASES}.{}", crate::lease_key(host_id, "*")),
            format!("$KV.{BUCKET_PRESENCE}.{}", crate::presence_key(host_id)),
            format!(
                "$JS.API.DIRECT.GET.KV_{BUCKET_LEASES}.$KV.{BUCKET_LEASES}.{}",
                crate::lease_key(host_id, "*")
            ),
            format!("$JS.API.DIRECT.GET.{STREAM_EVENTS}.agentscope.events.{host_id}.*"),
            format!("$JS.API.STREAM.INFO.KV_{BUCKET_LEASES}"),
            format!("$JS.API.STREAM.INFO.KV_{BUCKET_PRESENCE}"),
            format!("$JS.API.STREAM.INFO.{STREAM_CONTROL}"),
            format!("$JS.API.STREAM.INFO.{STREAM_EVENTS}"),
            format!("$JS.API.CONSUMER.INFO.{STREAM_CONTROL}.{consumer}"),
            format!(
                "$JS.API.CONSUMER.CREATE.{STREAM_CONTROL}.{consumer}.{}",
                subjects::control(host_id)
            ),
            format!("$JS.API.CONSUMER.MSG.NEXT.{STREAM_CONTROL}.{consumer}"),
            format!("$JS.ACK.{STREAM_CONTROL}.{consumer}.>"),
        ],
        subscribe: vec![
            format!("{inbox}.>"),
            format!("agentscope.pool.{workspace_id}.*.work"),
            subjects::host_offer(host_id),
        ],
    }
}

/// What a self-hosted Worker with id `worker_id` may do: register, beat into its presence key,
/// answer its own tool operations (the acknowledgement goes to the dataplane's inbox through the
/// server's response permission) and publish its own operations' progress and results.
pub fn worker_permissions(worker_id: &str, token: &str) -> Permissions {
    use crate::{BUCKET_WORKERS, subjects};
    Permissions {
        publish: vec![
            subjects::WORKER_REGISTER.to_string(),
            format!("$KV.{BUCKET_WORKERS}.worker.{worker_id}"),
            format!("$JS.API.STREAM.INFO.KV_{BUCKET_WORKERS}"),
            subjects::worker_progress(worker_id, "*"),
        ],
        subscribe: vec![
            format!("{}.>", worker_inbox(token)),
            subjects::worker_ops(worker_id),
        ],
    }
}

/// The parts of an authorization request the scheduler reads.
#[derive(Debug, Clone, Deserialize)]
pub struct AuthRequest {
    pub user_nkey: String,
    pub server_id: String,
    pub user: String,
    pub password: String,
}

impl AuthRequest {
    /// Reads the server's request JWT. The signature is not checked: only the server and the
    /// callout users (the platform's services) can publish on [`CALLOUT_SUBJECT`], and a forged
    /// request could only earn a JWT for a key its sender does not hold.
    pub fn parse(jwt: &[u8]) -> Result<AuthRequest, AuthError> {
        let text =
            std::str::from_utf8(jwt).map_err(|_| AuthError::BadRequest("not UTF-8".into()))?;
        let payload = text
            .split('.')
            .nth(1)
            .ok_or_else(|| AuthError::BadRequest("not a JWT".into()))?;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload.trim_end_matches('='))
            .map_err(|_| AuthError::BadRequest("payload is not base64url".into()))?;
        let claims: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|_| AuthError::BadRequest("payload is not JSON".into()))?;
        let nats = &claims["nats"];
        let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        let req = AuthRequest {
            user_nkey: s(&nats["user_nkey"]),
            server_id: s(&nats["server_id"]["id"]),
            user: s(&nats["connect_opts"]["user"]),
            password: s(&nats["connect_opts"]["pass"]),
        };
        if !is_user_key(&req.user_nkey) || req.server_id.is_empty() {
            return Err(AuthError::BadRequest(
                "no user nkey or server id in the request".into(),
            ));
        }
        Ok(req)
    }
}

/// The callout's answer: a user JWT with `perms` for `req`'s connection, or an error.
pub fn authorization_response(
    issuer: &AccountKey,
    req: &AuthRequest,
    outcome: Result<(&str, Permissions), &str>,
) -> String {
    let mut nats = json!({"type": "authorization_response", "version": 2});
    match outcome {
        Ok((name, perms)) => {
            let user = issuer.sign_jwt(json!({
                "sub": req.user_nkey,
                "name": name,
                // Non-operator mode: the audience names the account the client is placed in.
                "aud": "$G",
                "nats": {
                    "pub": {"allow": perms.publish},
                    "sub": {"allow": perms.subscribe},
                    // Replies to requests it received (a Worker answers its operations).
                    "resp": {"max": 1, "ttl": 0},
                    "subs": -1, "data": -1, "payload": -1,
                    "type": "user", "version": 2,
                }
            }));
            nats["jwt"] = json!(user);
        }
        Err(reason) => nats["error"] = json!(reason),
    }
    issuer.sign_jwt(json!({"sub": req.user_nkey, "aud": req.server_id, "nats": nats}))
}

/// Credentials for a whole installation: the callout issuer and one password per service.
#[derive(Clone)]
pub struct Setup {
    pub issuer: AccountKey,
    pub passwords: Vec<(String, String)>,
}

impl Setup {
    pub fn generate() -> Setup {
        use ring::rand::SecureRandom as _;
        let rng = ring::rand::SystemRandom::new();
        let passwords = SERVICE_USERS
            .iter()
            .map(|u| {
                let mut b = [0u8; 24];
                rng.fill(&mut b).expect("the system's random source");
                (u.to_string(), base32_encode(&b).to_lowercase())
            })
            .collect();
        Setup {
            issuer: AccountKey::generate(),
            passwords,
        }
    }

    pub fn password(&self, user: &str) -> &str {
        self.passwords
            .iter()
            .find(|(u, _)| u == user)
            .map(|(_, p)| p.as_str())
            .unwrap_or_default()
    }

    /// The `authorization` block of nats-server's configuration: the services as users that
    /// bypass the callout, everyone else through it.
    pub fn server_config(&self) -> String {
        let users: Vec<String> = self
            .passwords
            .iter()
            .map(|(u, p)| format!("    {{ user: \"{u}\", password: \"{p}\" }}"))
            .collect();
        let names: Vec<String> = self
            .passwords
            .iter()
            .map(|(u, _)| format!("\"{u}\""))
            .collect();
        format!(
            "authorization {{\n  timeout: 3\n  users: [\n{}\n  ]\n  auth_callout {{\n    issuer: \"{}\"\n    auth_users: [ {} ]\n  }}\n}}\n",
            users.join("\n"),
            self.issuer.public_key(),
            names.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_round_trip_and_keys_have_their_prefixes() {
        let k = AccountKey::generate();
        let seed = k.seed();
        assert!(seed.starts_with("SA"), "{seed}");
        assert_eq!(seed.len(), 58);
        let back = AccountKey::from_seed(&seed).unwrap();
        assert_eq!(back.public_key(), k.public_key());
        assert!(k.public_key().starts_with('A'));
        assert_eq!(k.public_key().len(), 56);
        let mut broken = seed.clone().into_bytes();
        broken[10] = if broken[10] == b'A' { b'B' } else { b'A' };
        assert!(AccountKey::from_seed(std::str::from_utf8(&broken).unwrap()).is_err());
    }

    #[test]
    fn user_keys_are_recognized() {
        let user = encode_public(PREFIX_USER, &[7u8; 32]);
        assert!(user.starts_with('U'));
        assert!(is_user_key(&user));
        assert!(!is_user_key("UABC"));
    }

    #[test]
    fn a_response_is_a_signed_jwt_for_the_requested_key() {
        let k = AccountKey::generate();
        let req = AuthRequest {
            user_nkey: encode_public(PREFIX_USER, &[1u8; 32]),
            server_id: "NSERVER".into(),
            user: "h".into(),
            password: "p".into(),
        };
        let jwt = authorization_response(&k, &req, Ok(("host", host_permissions("w", "h"))));
        let parts: Vec<&str> = jwt.split('.').collect();
        assert_eq!(parts.len(), 3);
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let claims: serde_json::Value =
            serde_json::from_slice(&b64.decode(parts[1]).unwrap()).unwrap();
        assert_eq!(claims["sub"], req.user_nkey.as_str());
        assert_eq!(claims["aud"], "NSERVER");
        assert_eq!(claims["nats"]["type"], "authorization_response");
        let sig = b64.decode(parts[2]).unwrap();
        let public = ring::signature::UnparsedPublicKey::new(
            &ring::signature::ED25519,
            k.pair.public_key().as_ref().to_vec(),
        );
        public
            .verify(format!("{}.{}", parts[0], parts[1]).as_bytes(), &sig)
            .unwrap();
    }

    #[test]
    fn a_host_may_publish_only_on_its_own_subjects() {
        let p = host_permissions("ws1", "h1");
        assert!(p.publish.iter().all(|s| !s.contains("h2")));
        assert!(p.publish.contains(&"agentscope.events.h1.*".to_string()));
        assert!(
            !p.publish
                .iter()
                .any(|s| s.starts_with("agentscope.approvals.decide"))
        );
        assert!(p.subscribe.iter().all(|s| !s.starts_with("_INBOX.")));
        // Offers: its own, received only; no host can make one.
        assert!(
            p.subscribe
                .contains(&"agentscope.host.h1.offer".to_string())
        );
        assert!(p.subscribe.iter().all(|s| !s.contains("h2")));
        assert!(p.publish.iter().all(|s| !s.ends_with(".offer")));
    }
}
