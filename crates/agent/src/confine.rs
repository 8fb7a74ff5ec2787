//! Confinement: every path a tool touches resolves inside the working
//! directory. A path is joined to the root, then the deepest part of it that
//! exists is canonicalized (symlinks and `..` resolved by the OS) and must lie
//! under the canonical root; the part that does not exist yet (a file to
//! create) may not climb with `..`. A dangling symlink is refused: writing
//! through it would create its target wherever it points.

use std::path::{Component, Path, PathBuf};

use crate::tools::ToolError;

/// The directory the tools work in (`--cwd`), canonical.
#[derive(Clone, Debug)]
pub struct Workspace {
    root: PathBuf,
}

impl Workspace {
    pub fn new(root: &Path) -> Result<Workspace, ToolError> {
        let root = root.canonicalize().map_err(|e| ToolError::io(root, e))?;
        Ok(Workspace { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `path` (relative to the root, or absolute) as a path inside the root,
    /// or `Outside`.
    pub fn resolve(&self, path: &str) -> Result<PathBuf, ToolError> {
        let outside = || ToolError::Outside {
            path: path.to_string(),
            root: self.root.display().to_string(),
        };
        let joined = self.root.join(path);
        // Split into the deepest entry that exists (as anything, a link
        // included) and the components after it.
        let mut existing = joined.as_path();
        let mut rest: Vec<Component> = Vec::new();
        while existing.symlink_metadata().is_err() {
            let Some(parent) = existing.parent() else {
                return Err(outside());
            };
            if let Some(c) = existing.components().next_back() {
                rest.push(c);
            }
            existing = parent;
        }
        // A dangling link does not canonicalize: refused with the rest.
        let base = existing.canonicalize().map_err(|_| outside())?;
        if !base.starts_with(&self.root) {
            return Err(outside());
        }
        let mut resolved = base;
        for c in rest.into_iter().rev() {
            match c {
                Component::Normal(n) => resolved.push(n),
                Component::CurDir => {}
                _ => return Err(outside()),
            }
        }
        Ok(resolved)
    }

    /// `path` relative to the root, for showing.
    pub fn show(&self, path: &Path) -> String {
        match path.strip_prefix(&self.root) {
            Ok(p) if p.as_os_str().is_empty() => ".".to_string(),
            Ok(p) => p.display().to_string(),
            Err(_) => path.display().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::testing::scratch;

    #[test]
    fn paths_inside_resolve_and_escapes_are_refused() {
        let (dir, ws) = scratch("confine");
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(dir.join("src/a.rs"), "x").unwrap();
        let root = ws.root().to_path_buf();
        assert_eq!(ws.resolve("src/a.rs").unwrap(), root.join("src/a.rs"));
        assert_eq!(
            ws.resolve("./src/../src/a.rs").unwrap(),
            root.join("src/a.rs")
        );
        assert_eq!(ws.resolve(".").unwrap(), root);
        // Not existing yet: the parent decides.
        assert_eq!(
            ws.resolve("src/new/b.rs").unwrap(),
            root.join("src/new/b.rs")
        );
        let abs_inside = root.join("src/a.rs");
        assert_eq!(
            ws.resolve(abs_inside.to_str().unwrap()).unwrap(),
            abs_inside
        );
        for bad in [
            "../x",
            "..",
            "src/../../x",
            "new/../../x",
            "/etc/passwd",
            "/tmp",
        ] {
            assert!(
                matches!(ws.resolve(bad), Err(ToolError::Outside { .. })),
                "{bad} resolved"
            );
        }
    }

    #[test]
    fn symlinks_out_of_the_root_are_refused() {
        let (dir, ws) = scratch("symlink");
        let (outside, _) = scratch("symlink-target");
        std::fs::write(outside.join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.join("nothing-yet"), dir.join("dangling")).unwrap();
        std::fs::write(dir.join("real"), "r").unwrap();
        std::os::unix::fs::symlink(dir.join("real"), dir.join("inner")).unwrap();
        for bad in ["link", "link/secret", "link/new-file", "dangling"] {
            assert!(
                matches!(ws.resolve(bad), Err(ToolError::Outside { .. })),
                "{bad} resolved"
            );
        }
        // A link that stays inside is followed.
        assert_eq!(ws.resolve("inner").unwrap(), ws.root().join("real"));
    }
}
