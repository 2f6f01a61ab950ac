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

/// Replaces every occurrence of each secret value in `text` with `[REDACTED:NAME]` (longest
/// values first, so that a secret containing another is replaced whole). Values shorter than 4
/// bytes are not redacted (they would mangle ordinary text); the Vault refuses them.
pub fn redact(text: &str, secrets: &[(String, String)]) -> String {
    let mut sorted: Vec<&(String, String)> = secrets.iter().filter(|(_, v)| v.len() >= 4).collect();
    sorted.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
    let mut out = text.to_string();
    for (name, value) in sorted {
        if out.contains(value.as_str()) {
            out = out.replace(value.as_str(), &format!("[REDACTED:{name}]"));
        }
    }
    out
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
}
