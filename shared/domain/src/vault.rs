//! The Vault's cipher: tool credentials are sealed with AES-256-GCM under a key from
//! configuration, the secret's workspace and name bound in as associated data (a ciphertext
//! moved to another row does not open). Several keys may be configured for rotation: the first
//! seals, any opens; re-sealing moves a secret to the first key.
//!
//! Configuration: `AGENTSCOPE_VAULT_KEYS="k2:<64 hex chars>,k1:<64 hex chars>"`.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

/// A configuration string that must never reach a log: its `Debug` is `***`.
#[derive(Clone, Default, serde::Deserialize, PartialEq)]
#[serde(transparent)]
pub struct SecretString(pub String);

impl std::fmt::Debug for SecretString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() { "\"\"" } else { "***" })
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum VaultError {
    #[error("vault keys: {0}")]
    Config(String),
    #[error("no vault key `{0}` is configured")]
    UnknownKey(String),
    #[error("the secret cannot be opened with its key (tampered, or sealed for another row)")]
    Open,
    #[error("no randomness available")]
    Random,
}

pub struct Keyring {
    /// (id, key); the first one seals.
    keys: Vec<(String, LessSafeKey)>,
}

/// A sealed secret as stored: the key's id, the nonce and the ciphertext with its tag.
#[derive(Debug, Clone, PartialEq)]
pub struct Sealed {
    pub key_id: String,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key material.
        f.debug_struct("Keyring")
            .field(
                "key_ids",
                &self.keys.iter().map(|k| &k.0).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Keyring {
    /// Parses `id:hex,id:hex`; empty means no Vault.
    pub fn parse(spec: &str) -> Result<Option<Keyring>, VaultError> {
        if spec.trim().is_empty() {
            return Ok(None);
        }
        let mut keys = vec![];
        for part in spec.split(',') {
            let (id, hex_key) = part.trim().split_once(':').ok_or_else(|| {
                VaultError::Config("each key is `id:hex` (64 hex characters)".into())
            })?;
            if id.is_empty()
                || !id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(VaultError::Config(format!("invalid key id `{id}`")));
            }
            let bytes = hex::decode(hex_key)
                .ok()
                .filter(|b| b.len() == 32)
                .ok_or_else(|| VaultError::Config(format!("key `{id}` must be 32 bytes in hex")))?;
            let key = UnboundKey::new(&AES_256_GCM, &bytes)
                .map_err(|_| VaultError::Config(format!("key `{id}` is unusable")))?;
            if keys.iter().any(|(k, _)| k == id) {
                return Err(VaultError::Config(format!("key id `{id}` appears twice")));
            }
            keys.push((id.to_string(), LessSafeKey::new(key)));
        }
        Ok(Some(Keyring { keys }))
    }

    pub fn current_key_id(&self) -> &str {
        &self.keys[0].0
    }

    fn aad(workspace: &str, name: &str) -> Vec<u8> {
        format!("agentscope-vault:{workspace}:{name}").into_bytes()
    }

    /// Seals `value` under the current key for (`workspace`, `name`).
    pub fn seal(&self, workspace: &str, name: &str, value: &[u8]) -> Result<Sealed, VaultError> {
        let (id, key) = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| VaultError::Random)?;
        let mut buf = value.to_vec();
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(Self::aad(workspace, name)),
            &mut buf,
        )
        .map_err(|_| VaultError::Open)?;
        Ok(Sealed {
            key_id: id.clone(),
            nonce: nonce.to_vec(),
            ciphertext: buf,
        })
    }

    /// Opens a sealed secret with the key it names.
    pub fn open(&self, workspace: &str, name: &str, s: &Sealed) -> Result<Vec<u8>, VaultError> {
        let key = self
            .keys
            .iter()
            .find(|(id, _)| *id == s.key_id)
            .map(|(_, k)| k)
            .ok_or_else(|| VaultError::UnknownKey(s.key_id.clone()))?;
        let nonce: [u8; NONCE_LEN] = s
            .nonce
            .as_slice()
            .try_into()
            .map_err(|_| VaultError::Open)?;
        let mut buf = s.ciphertext.clone();
        let plain = key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(Self::aad(workspace, name)),
                &mut buf,
            )
            .map_err(|_| VaultError::Open)?;
        Ok(plain.to_vec())
    }

    /// Rotation: the secret sealed under the current key (None when it already is).
    pub fn reseal(
        &self,
        workspace: &str,
        name: &str,
        s: &Sealed,
    ) -> Result<Option<Sealed>, VaultError> {
        if s.key_id == self.current_key_id() {
            return Ok(None);
        }
        let plain = self.open(workspace, name, s)?;
        self.seal(workspace, name, &plain).map(Some)
    }
}

/// Secrets shorter than this many bytes are not redacted (they would mangle ordinary text); the
/// Vault refuses them.
pub const MIN_SECRET_LEN: usize = 4;

/// Redacts a fixed set of secrets from text: each value and its encoded forms (see
/// [`encoded_forms`]) become `[REDACTED:NAME]`. Build it once per set of secrets; `redact` is
/// one pass over the text (Aho-Corasick, leftmost-longest, so a secret containing another is
/// replaced whole).
pub struct Redactor {
    matcher: Option<aho_corasick::AhoCorasick>,
    replacements: Vec<String>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the needles: they are the secrets.
        f.debug_struct("Redactor")
            .field("needles", &self.replacements.len())
            .finish()
    }
}

impl Redactor {
    /// `(name, value)` pairs; values shorter than [`MIN_SECRET_LEN`] bytes are skipped.
    pub fn new(secrets: &[(String, String)]) -> Redactor {
        Redactor::build(secrets, None)
    }

    /// As [`Redactor::new`], with a matcher that is built in microseconds instead of the few
    /// hundred a DFA takes, and searches more slowly: for a matcher built often and used on short
    /// texts (a host builds one per attempt, for its events).
    pub fn new_quick(secrets: &[(String, String)]) -> Redactor {
        Redactor::build(secrets, Some(aho_corasick::AhoCorasickKind::ContiguousNFA))
    }

    fn build(
        secrets: &[(String, String)],
        kind: Option<aho_corasick::AhoCorasickKind>,
    ) -> Redactor {
        let mut needles: Vec<Vec<u8>> = vec![];
        let mut replacements = vec![];
        let mut seen = std::collections::HashSet::new();
        for (name, value) in secrets {
            if value.len() < MIN_SECRET_LEN {
                continue;
            }
            for form in encoded_forms(value.as_bytes()) {
                if seen.insert(form.clone()) {
                    needles.push(form);
                    replacements.push(format!("[REDACTED:{name}]"));
                }
            }
        }
        let matcher = if needles.is_empty() {
            None
        } else {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .kind(kind)
                .build(&needles)
                .ok()
        };
        Redactor {
            matcher,
            replacements,
        }
    }

    /// Values without names: each becomes `[REDACTED:label]`.
    pub fn for_values(label: &str, values: &[&str]) -> Redactor {
        let pairs: Vec<(String, String)> = values
            .iter()
            .map(|v| (label.to_string(), v.to_string()))
            .collect();
        Redactor::new(&pairs)
    }

    pub fn is_empty(&self) -> bool {
        self.matcher.is_none()
    }

    pub fn redact(&self, text: &str) -> String {
        match &self.matcher {
            Some(m) => m.replace_all(text, &self.replacements),
            None => text.to_string(),
        }
    }
}

/// Replaces every occurrence of each secret value and of its encoded forms in `text` with
/// `[REDACTED:NAME]`. For many texts with the same secrets, build a [`Redactor`] once.
pub fn redact(text: &str, secrets: &[(String, String)]) -> String {
    Redactor::new(secrets).redact(text)
}

/// Replaces every occurrence of each of `values` and of their encoded forms in `text` with
/// `[REDACTED]` (for credentials that have no Vault name, such as a task token).
pub fn redact_values(text: &str, values: &[&str]) -> String {
    let pairs: Vec<(String, String)> = values
        .iter()
        .map(|v| (String::new(), v.to_string()))
        .collect();
    match Redactor::new(&pairs).matcher {
        Some(m) => m.replace_all(text, &vec!["[REDACTED]"; m.patterns_len()]),
        None => text.to_string(),
    }
}

const B64_STD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const B64_URL: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// Base64 of `bytes` without padding; the last character may be partial (its low bits zero).
fn base64(bytes: &[u8], alphabet: &[u8; 64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let chars = chunk.len() + 1;
        for i in 0..chars {
            out.push(alphabet[((n >> (18 - 6 * i)) & 63) as usize]);
        }
    }
    out
}

/// The forms of a secret that redaction looks for: the value itself; its base64 (standard and
/// URL-safe alphabets, padded and not); the characters that encode it inside a longer base64
/// text at each of the three byte alignments (the partial characters at both edges, which
/// depend on the neighbouring bytes, trimmed); its hex in lower and upper case; its
/// URL-encoding (every byte but the unreserved `A-Za-z0-9-._~` as `%XX`, upper and lower case,
/// also with `+` for a space, and the `encodeURIComponent` variant that keeps `!'()*`).
pub fn encoded_forms(value: &[u8]) -> Vec<Vec<u8>> {
    let mut forms = vec![value.to_vec()];
    for alphabet in [B64_STD, B64_URL] {
        let plain = base64(value, alphabet);
        let mut padded = plain.clone();
        while !padded.len().is_multiple_of(4) {
            padded.push(b'=');
        }
        forms.push(padded);
        forms.push(plain);
        for shift in 0..3usize {
            let mut shifted = vec![0u8; shift];
            shifted.extend_from_slice(value);
            let enc = base64(&shifted, alphabet);
            // Characters whose 6 bits all come from the secret.
            let first = (8 * shift).div_ceil(6);
            let end = (8 * (shift + value.len())) / 6;
            if end > first && end - first >= MIN_SECRET_LEN {
                forms.push(enc[first..end].to_vec());
            }
        }
    }
    forms.push(hex::encode(value).into_bytes());
    forms.push(hex::encode_upper(value).into_bytes());
    let url = |keep: &[u8], plus: bool, upper: bool| -> Vec<u8> {
        let mut out = vec![];
        for &b in value {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || keep.contains(&b) {
                out.push(b);
            } else if plus && b == b' ' {
                out.push(b'+');
            } else if upper {
                out.extend(format!("%{b:02X}").bytes());
            } else {
                out.extend(format!("%{b:02x}").bytes());
            }
        }
        out
    };
    forms.push(url(b"", false, true));
    forms.push(url(b"", false, false));
    forms.push(url(b"", true, true));
    forms.push(url(b"", true, false));
    forms.push(url(b"!'()*", false, true));
    forms.retain(|f| f.len() >= MIN_SECRET_LEN);
    forms.sort();
    forms.dedup();
    forms
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const K2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    #[test]
    fn seal_open_and_rotate() {
        let old = Keyring::parse(&format!("k1:{K1}")).unwrap().unwrap();
        let s = old.seal("ws", "TOKEN", b"s3cret").unwrap();
        assert_eq!(s.key_id, "k1");
        assert!(!s.ciphertext.windows(6).any(|w| w == b"s3cret"));
        assert_eq!(old.open("ws", "TOKEN", &s).unwrap(), b"s3cret");
        let rotated = Keyring::parse(&format!("k2:{K2},k1:{K1}"))
            .unwrap()
            .unwrap();
        assert_eq!(
            rotated.open("ws", "TOKEN", &s).unwrap(),
            b"s3cret",
            "old keys still open"
        );
        let moved = rotated.reseal("ws", "TOKEN", &s).unwrap().unwrap();
        assert_eq!(moved.key_id, "k2");
        assert_eq!(rotated.open("ws", "TOKEN", &moved).unwrap(), b"s3cret");
        assert!(rotated.reseal("ws", "TOKEN", &moved).unwrap().is_none());
        assert_eq!(
            old.open("ws", "TOKEN", &moved),
            Err(VaultError::UnknownKey("k2".into()))
        );
    }

    #[test]
    fn a_ciphertext_is_bound_to_its_row_and_tampering_is_detected() {
        let k = Keyring::parse(&format!("k1:{K1}")).unwrap().unwrap();
        let s = k.seal("ws", "TOKEN", b"s3cret").unwrap();
        assert_eq!(k.open("ws", "OTHER", &s), Err(VaultError::Open));
        assert_eq!(k.open("ws2", "TOKEN", &s), Err(VaultError::Open));
        let mut t = s.clone();
        t.ciphertext[0] ^= 1;
        assert_eq!(k.open("ws", "TOKEN", &t), Err(VaultError::Open));
        let again = k.seal("ws", "TOKEN", b"s3cret").unwrap();
        assert_ne!(again.nonce, s.nonce, "a fresh nonce per seal");
    }

    #[test]
    fn bad_key_configuration_is_refused_by_name() {
        assert!(Keyring::parse("").unwrap().is_none());
        for bad in [
            "k1",
            "k1:zz",
            "k1:1234",
            &format!("k1:{K1},k1:{K2}"),
            &format!("a b:{K1}"),
        ] {
            assert!(
                matches!(Keyring::parse(bad), Err(VaultError::Config(_))),
                "{bad}"
            );
        }
        let dbg = format!(
            "{:?}",
            Keyring::parse(&format!("k1:{K1}")).unwrap().unwrap()
        );
        assert!(!dbg.contains("1111"), "{dbg}");
    }

    #[test]
    fn redaction_replaces_every_occurrence_longest_first() {
        let secrets = vec![
            ("A".to_string(), "abcd".to_string()),
            ("B".to_string(), "abcdefgh".to_string()),
            ("C".to_string(), "xy".to_string()),
        ];
        assert_eq!(
            redact("abcdefgh and abcd and xy", &secrets),
            "[REDACTED:B] and [REDACTED:A] and xy"
        );
    }

    fn std_b64(b: &[u8]) -> String {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    #[test]
    fn our_base64_is_base64() {
        use base64::Engine as _;
        for v in [
            &b"a"[..],
            b"ab",
            b"abc",
            b"abcd",
            b"\xff\xfe\x00 x?/+",
            b"hunter2-secret",
        ] {
            let mut padded = String::from_utf8(base64(v, B64_STD)).unwrap();
            while !padded.len().is_multiple_of(4) {
                padded.push('=');
            }
            assert_eq!(padded, std_b64(v));
            assert_eq!(
                String::from_utf8(base64(v, B64_URL)).unwrap(),
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v)
            );
        }
    }

    const S: &str = "s3cr3t value/+?&=~x";

    #[test]
    fn encoded_forms_of_a_secret_are_redacted() {
        use base64::Engine as _;
        use base64::engine::general_purpose::{
            STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD,
        };
        let secrets = vec![("TOKEN".to_string(), S.to_string())];
        let b = S.as_bytes();
        // The quick-to-build matcher finds what the DFA finds.
        for r in [Redactor::new(&secrets), Redactor::new_quick(&secrets)] {
            for form in [
                S.to_string(),
                STANDARD.encode(b),
                STANDARD_NO_PAD.encode(b),
                URL_SAFE.encode(b),
                URL_SAFE_NO_PAD.encode(b),
                hex::encode(b),
                hex::encode_upper(b),
                "s3cr3t%20value%2F%2B%3F%26%3D~x".to_string(),
                "s3cr3t%20value%2f%2b%3f%26%3d~x".to_string(),
                "s3cr3t+value%2F%2B%3F%26%3D~x".to_string(),
            ] {
                let text = format!("before {form} after");
                let out = r.redact(&text);
                assert_eq!(out, "before [REDACTED:TOKEN] after", "{form}");
            }
        }
    }

    #[test]
    fn a_secret_inside_a_longer_base64_text_is_redacted_at_every_alignment() {
        let secrets = vec![("TOKEN".to_string(), S.to_string())];
        let r = Redactor::new(&secrets);
        for prefix in ["", "x", "xy", "xyz", "a longer prefix "] {
            for suffix in ["", "\n", "!", "ab", "and more text after it"] {
                let text = std_b64(format!("{prefix}{S}{suffix}").as_bytes());
                let out = r.redact(&text);
                assert!(
                    out.contains("[REDACTED:TOKEN]"),
                    "{prefix:?}/{suffix:?}: {out}"
                );
                // What is left of the encoding decodes to at most a few bytes of the secret.
                let left: String = out.replace("[REDACTED:TOKEN]", "");
                assert!(left.len() <= std_b64(format!("{prefix}{suffix}").as_bytes()).len() + 8);
            }
        }
    }

    #[test]
    fn redaction_of_values_without_names() {
        let out = redact_values(
            &format!("tok agt_abcdef and {}", hex::encode("agt_abcdef")),
            &["agt_abcdef"],
        );
        assert_eq!(out, "tok [REDACTED] and [REDACTED]");
        assert_eq!(redact_values("abc", &[]), "abc");
        assert_eq!(redact_values("abc", &["ab"]), "abc", "too short to redact");
        let dbg = format!("{:?}", Redactor::for_values("T", &["agt_abcdef"]));
        assert!(!dbg.contains("agt_"), "{dbg}");
    }

    proptest::proptest! {
        #[test]
        fn any_secret_in_any_encoding_context_is_redacted(
            secret in proptest::collection::vec(proptest::prelude::any::<u8>(), 4..40),
            prefix in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..10),
            suffix in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..10),
        ) {
            let value = String::from_utf8_lossy(&secret).into_owned();
            let secrets = vec![("K".to_string(), value.clone())];
            let r = Redactor::new(&secrets);
            let mut all = prefix.clone();
            all.extend_from_slice(value.as_bytes());
            all.extend_from_slice(&suffix);
            for text in [std_b64(&all), hex::encode(value.as_bytes()), format!("a{value}b")] {
                proptest::prop_assert!(r.redact(&text).contains("[REDACTED:K]"), "{}", text);
            }
        }
    }
}
