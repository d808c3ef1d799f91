//! Who a request's API key belongs to, and the cache namespace that follows from it. Prefix sharing shows in the
//! time to first token, so a tenant that could hit another's cached blocks could tell which prompts the other
//! sent; by default each tenant's prompts are hashed apart (`cache_salt` narrows further within a tenant).

/// The keys the router accepts: keys of no tenant, and keys bound to one.
#[derive(Clone, Debug, Default)]
pub struct Tenants {
    open: Vec<String>,
    /// (key, tenant).
    bound: Vec<(String, String)>,
    /// Tenants share cached prompts after all.
    share: bool,
}

/// The request's key is missing or not one the router accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unauthorized;

impl Tenants {
    /// `open`: keys of no tenant; `bound`: (tenant, key) pairs; `share`: tenants share cached prompts.
    pub fn new(open: Vec<String>, bound: Vec<(String, String)>, share: bool) -> Tenants {
        let bound = bound.into_iter().map(|(tenant, key)| (key, tenant)).collect();
        Tenants { open, bound, share }
    }

    /// Keys of no tenant only (no keys: none needed).
    pub fn open(keys: Vec<String>) -> Tenants {
        Tenants::new(keys, Vec::new(), false)
    }

    /// Whether requests need a key at all.
    pub fn keys_required(&self) -> bool {
        !self.open.is_empty() || !self.bound.is_empty()
    }

    /// The tenant of a request carrying `key` (`None`: no tenant), or [`Unauthorized`]. Every key is compared in
    /// full, so the time taken does not tell which keys exist.
    pub fn identify(&self, key: Option<&str>) -> Result<Option<&str>, Unauthorized> {
        if !self.keys_required() {
            return Ok(None);
        }
        let key = key.ok_or(Unauthorized)?.as_bytes();
        let mut found = None;
        let mut open = false;
        for k in &self.open {
            open |= constant_time_eq(k.as_bytes(), key);
        }
        for (k, tenant) in &self.bound {
            if constant_time_eq(k.as_bytes(), key) {
                found = Some(tenant.as_str());
            }
        }
        match (found, open) {
            (Some(t), _) => Ok(Some(t)),
            (None, true) => Ok(None),
            (None, false) => Err(Unauthorized),
        }
    }

    /// Whether tenants' prompts are cached apart: there are tenants, and they do not share.
    pub fn isolated(&self) -> bool {
        !self.bound.is_empty() && !self.share
    }

    /// The cache namespace of a request from `tenant` with `salt` (its `cache_salt`): the salt alone without a
    /// tenant (or when tenants share), else the tenant and the salt. A salt has no NUL (the request check refuses
    /// one) and a tenant name none either, so no salt names a tenant's namespace and no two tenants' meet.
    pub fn namespace(&self, tenant: Option<&str>, salt: Option<&str>) -> Option<String> {
        let salt = salt.filter(|s| !s.is_empty());
        match tenant.filter(|_| !self.share) {
            None => salt.map(str::to_string),
            Some(t) => Some(format!("{t}\0{}", salt.unwrap_or(""))),
        }
    }
}

/// Reads `TENANT:KEY` entries (a key may itself hold `:`; a tenant name may not be empty or hold NUL).
pub fn parse(entries: &[String]) -> Result<Vec<(String, String)>, String> {
    entries
        .iter()
        .filter(|e| !e.is_empty())
        .map(|e| match e.split_once(':') {
            Some((tenant, key)) if !tenant.is_empty() && !key.is_empty() && !tenant.contains('\0') => {
                Ok((tenant.to_string(), key.to_string()))
            }
            _ => Err(format!("expected TENANT:KEY, got {:?}", e.split(':').next().unwrap_or_default())),
        })
        .collect()
}

/// Compares without an early exit, so the time taken does not reveal how much of a key was right.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_tenants_and_tenants_are_cached_apart() {
        let bound = parse(&["team-a:sk-a".into(), "team-b:sk-b:with-colon".into()]).expect("valid");
        let t = Tenants::new(vec!["sk-open".into()], bound, false);
        assert_eq!(t.identify(Some("sk-a")), Ok(Some("team-a")));
        assert_eq!(t.identify(Some("sk-b:with-colon")), Ok(Some("team-b")));
        assert_eq!(t.identify(Some("sk-open")), Ok(None));
        assert_eq!(t.identify(Some("sk-c")), Err(Unauthorized));
        assert_eq!(t.identify(None), Err(Unauthorized));
        // Each tenant its own namespace, salted or not; no tenant: the salt alone, as before tenants existed.
        let (a, b) = (t.namespace(Some("team-a"), None), t.namespace(Some("team-b"), None));
        assert!(a.is_some() && a != b);
        assert_ne!(t.namespace(Some("team-a"), Some("s")), a);
        assert_eq!(t.namespace(None, Some("s")).as_deref(), Some("s"));
        assert_eq!(t.namespace(None, Some("")), None);
        // Sharing on purpose: the tenant no longer counts.
        let shared = Tenants::new(Vec::new(), parse(&["a:k".into()]).expect("valid"), true);
        assert_eq!(shared.namespace(Some("a"), None), None);
        assert!(parse(&[":key".into()]).is_err() && parse(&["tenant".into()]).is_err());
        assert!(!Tenants::open(Vec::new()).keys_required());
        assert_eq!(Tenants::open(Vec::new()).identify(None), Ok(None));
    }
}
