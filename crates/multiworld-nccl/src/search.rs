//! Where to look for `libnccl.so.2` and `libcuda.so.1`, computed from the
//! environment and the file system without running Python. [`LibrarySearch`]
//! captures the inputs (so tests can fake them) and turns them into an
//! ordered candidate list; `runtime.rs` tries the candidates in order and
//! reports every one it tried.
//!
//! NCCL order (first that loads wins):
//! 1. `NCCL_LIBRARY`, when set and non-empty, is the **only** candidate: an
//!    explicit path that does not load is an error, never a silent fallback
//!    to some other NCCL.
//! 2. `libnccl.so.2`, then `libnccl.so`, by bare name: the dynamic loader's
//!    own search (the `LD_LIBRARY_PATH` seen at process start, `RUNPATH`,
//!    `ld.so.cache`, `/lib`, `/usr/lib`).
//! 3. `<dir>/libnccl.so.2` for each entry of the current `LD_LIBRARY_PATH`.
//! 4. The pip wheel location `<site>/nvidia/nccl/lib/libnccl.so.2` for each
//!    site directory, in this order: `$VIRTUAL_ENV`, `$CONDA_PREFIX`, each
//!    `PYTHONPATH` entry (itself a site directory), the prefix of each
//!    `python3` on `PATH` (both the venv prefix and the resolved
//!    interpreter's prefix), `$HOME/.local`, every `$PYENV_ROOT/versions/*`
//!    (default `~/.pyenv`), `/usr/local`, `/usr`, `/opt/conda`. For a prefix
//!    `P`, the site directories are `P/lib{,64}/python3*/{site,dist}-packages`,
//!    newest Python first.
//! 5. `$CONDA_PREFIX/lib/libnccl.so.2` (conda's `nccl` package).
//!
//! CUDA driver order: `CUDA_DRIVER_LIBRARY`, when set and non-empty, is the
//! only candidate (like `NCCL_LIBRARY`; meant for unusual installs and for
//! tests); otherwise `libcuda.so.1`, `libcuda.so` by bare name, then
//! `<dir>/libcuda.so.1` for each `LD_LIBRARY_PATH` entry, then the usual
//! driver locations (`/usr/lib/x86_64-linux-gnu`, `/usr/lib/aarch64-linux-gnu`,
//! `/usr/lib64`, `/usr/local/nvidia/lib64`, `/usr/lib/wsl/lib`). The CUDA
//! toolkit's `stubs/libcuda.so` is deliberately not searched: it loads but
//! fails every call.

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// One place to try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// A bare library name (resolved by the dynamic loader) or an absolute
    /// path.
    pub name: PathBuf,
    /// Why this candidate is in the list (e.g. `"NCCL_LIBRARY"`,
    /// `"pip wheel under $VIRTUAL_ENV"`).
    pub origin: &'static str,
}

impl Candidate {
    fn new(name: impl Into<PathBuf>, origin: &'static str) -> Candidate {
        Candidate {
            name: name.into(),
            origin,
        }
    }

    /// True for a bare name that the dynamic loader resolves itself.
    pub fn is_bare_name(&self) -> bool {
        self.name.components().count() == 1 && !self.name.is_absolute()
    }
}

/// The inputs of the library search. [`LibrarySearch::from_env`] fills them
/// from the process environment; tests build them by hand.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LibrarySearch {
    /// `NCCL_LIBRARY`: full path of `libnccl.so.2`; when set, the only NCCL
    /// candidate.
    pub nccl_library: Option<PathBuf>,
    /// `CUDA_DRIVER_LIBRARY`: full path of `libcuda.so.1`; when set, the only
    /// CUDA driver candidate.
    pub cuda_driver_library: Option<PathBuf>,
    /// `LD_LIBRARY_PATH` entries.
    pub ld_library_path: Vec<PathBuf>,
    /// `VIRTUAL_ENV`.
    pub virtual_env: Option<PathBuf>,
    /// `CONDA_PREFIX`.
    pub conda_prefix: Option<PathBuf>,
    /// `PYTHONPATH` entries.
    pub python_path: Vec<PathBuf>,
    /// `PATH` entries (searched for `python3`).
    pub path: Vec<PathBuf>,
    /// `HOME`.
    pub home: Option<PathBuf>,
    /// `PYENV_ROOT` (default `$HOME/.pyenv`).
    pub pyenv_root: Option<PathBuf>,
    /// System prefixes searched last (`/usr/local`, `/usr`, `/opt/conda`).
    pub system_prefixes: Vec<PathBuf>,
    /// Directories where a driver's `libcuda.so.1` usually lives.
    pub driver_dirs: Vec<PathBuf>,
}

fn non_empty_var(name: &str) -> Option<OsString> {
    env::var_os(name).filter(|v| !v.is_empty())
}

fn split_paths_var(name: &str) -> Vec<PathBuf> {
    non_empty_var(name)
        .map(|v| {
            env::split_paths(&v)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default()
}

impl LibrarySearch {
    /// The search described in the module docs, from the current
    /// environment.
    pub fn from_env() -> LibrarySearch {
        let home = non_empty_var("HOME").map(PathBuf::from);
        let pyenv_root = non_empty_var("PYENV_ROOT")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".pyenv")));
        LibrarySearch {
            nccl_library: non_empty_var("NCCL_LIBRARY").map(PathBuf::from),
            cuda_driver_library: non_empty_var("CUDA_DRIVER_LIBRARY").map(PathBuf::from),
            ld_library_path: split_paths_var("LD_LIBRARY_PATH"),
            virtual_env: non_empty_var("VIRTUAL_ENV").map(PathBuf::from),
            conda_prefix: non_empty_var("CONDA_PREFIX").map(PathBuf::from),
            python_path: split_paths_var("PYTHONPATH"),
            path: split_paths_var("PATH"),
            home,
            pyenv_root,
            system_prefixes: ["/usr/local", "/usr", "/opt/conda"]
                .iter()
                .map(PathBuf::from)
                .collect(),
            driver_dirs: [
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib/aarch64-linux-gnu",
                "/usr/lib64",
                "/usr/local/nvidia/lib64",
                "/usr/lib/wsl/lib",
            ]
            .iter()
            .map(PathBuf::from)
            .collect(),
        }
    }

    /// NCCL candidates, in the order they are tried.
    pub fn nccl_candidates(&self) -> Vec<Candidate> {
        if let Some(explicit) = &self.nccl_library {
            return vec![Candidate::new(explicit.clone(), "NCCL_LIBRARY")];
        }
        let mut out = vec![
            Candidate::new("libnccl.so.2", "dynamic loader search"),
            Candidate::new("libnccl.so", "dynamic loader search"),
        ];
        for dir in &self.ld_library_path {
            out.push(Candidate::new(dir.join("libnccl.so.2"), "LD_LIBRARY_PATH"));
        }
        for (site, origin) in self.site_dirs() {
            out.push(Candidate::new(
                site.join("nvidia").join("nccl").join("lib").join("libnccl.so.2"),
                origin,
            ));
        }
        if let Some(conda) = &self.conda_prefix {
            out.push(Candidate::new(
                conda.join("lib").join("libnccl.so.2"),
                "conda package under $CONDA_PREFIX",
            ));
        }
        dedup(out)
    }

    /// CUDA driver candidates, in the order they are tried.
    pub fn cuda_driver_candidates(&self) -> Vec<Candidate> {
        if let Some(explicit) = &self.cuda_driver_library {
            return vec![Candidate::new(explicit.clone(), "CUDA_DRIVER_LIBRARY")];
        }
        let mut out = vec![
            Candidate::new("libcuda.so.1", "dynamic loader search"),
            Candidate::new("libcuda.so", "dynamic loader search"),
        ];
        for dir in &self.ld_library_path {
            out.push(Candidate::new(dir.join("libcuda.so.1"), "LD_LIBRARY_PATH"));
        }
        for dir in &self.driver_dirs {
            out.push(Candidate::new(dir.join("libcuda.so.1"), "driver directory"));
        }
        dedup(out)
    }

    /// Python site directories (with the origin of each), in search order.
    /// Touches the file system only to expand `python3*` and
    /// `$PYENV_ROOT/versions/*` and to find `python3` on `PATH`.
    pub fn site_dirs(&self) -> Vec<(PathBuf, &'static str)> {
        let mut out = Vec::new();
        if let Some(venv) = &self.virtual_env {
            push_prefix_sites(&mut out, venv, "pip wheel under $VIRTUAL_ENV");
        }
        if let Some(conda) = &self.conda_prefix {
            push_prefix_sites(&mut out, conda, "pip wheel under $CONDA_PREFIX");
        }
        for entry in &self.python_path {
            out.push((entry.clone(), "pip wheel on PYTHONPATH"));
        }
        for dir in &self.path {
            let exe = dir.join("python3");
            if !exe.is_file() {
                continue;
            }
            if let Some(prefix) = dir.parent() {
                push_prefix_sites(&mut out, prefix, "pip wheel of python3 on PATH");
            }
            if let Ok(real) = exe.canonicalize() {
                if let Some(prefix) = real.parent().and_then(Path::parent) {
                    push_prefix_sites(&mut out, prefix, "pip wheel of python3 on PATH");
                }
            }
        }
        if let Some(home) = &self.home {
            push_prefix_sites(&mut out, &home.join(".local"), "pip wheel under ~/.local");
        }
        if let Some(root) = &self.pyenv_root {
            for version in sorted_children(&root.join("versions"), |_| true) {
                push_prefix_sites(&mut out, &version, "pip wheel under pyenv");
            }
        }
        for prefix in &self.system_prefixes {
            push_prefix_sites(&mut out, prefix, "pip wheel under a system prefix");
        }
        let mut seen = std::collections::HashSet::new();
        out.retain(|(p, _)| seen.insert(p.clone()));
        out
    }
}

/// Adds `prefix/lib{,64}/python3*/{site,dist}-packages` that exist, newest
/// Python first.
fn push_prefix_sites(out: &mut Vec<(PathBuf, &'static str)>, prefix: &Path, origin: &'static str) {
    for lib in ["lib", "lib64"] {
        let pythons = sorted_children(&prefix.join(lib), |name| name.starts_with("python3"));
        for py in pythons {
            for site in ["site-packages", "dist-packages"] {
                let dir = py.join(site);
                if dir.is_dir() {
                    out.push((dir, origin));
                }
            }
        }
    }
}

/// Sub-directories of `dir` whose name passes `keep`, newest version first
/// (`python3.12` before `python3.9`).
fn sorted_children(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .map(|e| e.path())
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
    found
}

/// Sort key that orders `python3.12` after `python3.9`: the numbers in the
/// name, then the name.
fn version_key(p: &Path) -> (Vec<u64>, String) {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let nums = name
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect();
    (nums, name)
}

fn dedup(candidates: Vec<Candidate>) -> Vec<Candidate> {
    let mut seen = std::collections::HashSet::new();
    candidates
        .into_iter()
        .filter(|c| seen.insert(c.name.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A scratch directory removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let dir = env::temp_dir().join(format!(
                "mw-nccl-search-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn mkdir(&self, rel: &str) -> PathBuf {
            let p = self.0.join(rel);
            fs::create_dir_all(&p).unwrap();
            p
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn explicit_nccl_library_is_the_only_candidate() {
        let s = LibrarySearch {
            nccl_library: Some("/nonexistent/libnccl.so.2".into()),
            ld_library_path: vec!["/opt/x".into()],
            ..LibrarySearch::default()
        };
        assert_eq!(
            s.nccl_candidates(),
            vec![Candidate::new("/nonexistent/libnccl.so.2", "NCCL_LIBRARY")]
        );
    }

    #[test]
    fn default_order_is_loader_then_ld_path_then_wheels_then_conda() {
        let scratch = Scratch::new("order");
        let venv = scratch.0.join("venv");
        let venv_site = scratch.mkdir("venv/lib/python3.11/site-packages");
        let conda = scratch.0.join("conda");
        let conda_site = scratch.mkdir("conda/lib/python3.10/site-packages");
        let s = LibrarySearch {
            ld_library_path: vec!["/opt/a".into(), "/opt/b".into()],
            virtual_env: Some(venv),
            conda_prefix: Some(conda.clone()),
            python_path: vec!["/pp".into()],
            ..LibrarySearch::default()
        };
        let names: Vec<PathBuf> = s.nccl_candidates().into_iter().map(|c| c.name).collect();
        let wheel = |site: &Path| site.join("nvidia/nccl/lib/libnccl.so.2");
        assert_eq!(
            names,
            vec![
                PathBuf::from("libnccl.so.2"),
                PathBuf::from("libnccl.so"),
                PathBuf::from("/opt/a/libnccl.so.2"),
                PathBuf::from("/opt/b/libnccl.so.2"),
                wheel(&venv_site),
                wheel(&conda_site),
                wheel(Path::new("/pp")),
                conda.join("lib/libnccl.so.2"),
            ]
        );
    }

    #[test]
    fn newest_python_first_and_dist_packages_and_lib64() {
        let scratch = Scratch::new("pythons");
        let p39 = scratch.mkdir("usr/lib/python3.9/site-packages");
        let p312 = scratch.mkdir("usr/lib/python3.12/dist-packages");
        let p3 = scratch.mkdir("usr/lib/python3/dist-packages");
        let l64 = scratch.mkdir("usr/lib64/python3.11/site-packages");
        scratch.mkdir("usr/lib/perl5");
        let s = LibrarySearch {
            system_prefixes: vec![scratch.0.join("usr")],
            ..LibrarySearch::default()
        };
        let dirs: Vec<PathBuf> = s.site_dirs().into_iter().map(|(p, _)| p).collect();
        assert_eq!(dirs, vec![p312, p39, p3, l64]);
    }

    #[test]
    fn python_on_path_contributes_its_prefix_and_pyenv_versions_are_searched() {
        let scratch = Scratch::new("path");
        let bin = scratch.mkdir("env/bin");
        fs::write(bin.join("python3"), b"").unwrap();
        let site = scratch.mkdir("env/lib/python3.11/site-packages");
        let pyenv_site = scratch.mkdir("pyenv/versions/3.11.7/lib/python3.11/site-packages");
        let home_site = scratch.mkdir("home/.local/lib/python3.11/site-packages");
        let s = LibrarySearch {
            path: vec![bin, scratch.0.join("no-python-here")],
            home: Some(scratch.0.join("home")),
            pyenv_root: Some(scratch.0.join("pyenv")),
            ..LibrarySearch::default()
        };
        let dirs: Vec<(PathBuf, &str)> = s.site_dirs();
        assert_eq!(
            dirs,
            vec![
                (site, "pip wheel of python3 on PATH"),
                (home_site, "pip wheel under ~/.local"),
                (pyenv_site, "pip wheel under pyenv"),
            ]
        );
    }

    /// A venv that is not activated (no `$VIRTUAL_ENV`), only its `python3`
    /// on `PATH`, a symlink to a Python 3.12 elsewhere (as `python -m venv`
    /// and `uv venv` make it): the wheel inside the venv is a candidate, and
    /// comes before the base interpreter's.
    #[cfg(unix)]
    #[test]
    fn the_wheel_of_a_venv_python3_12_on_path_is_a_candidate() {
        let scratch = Scratch::new("venv312");
        let base_bin = scratch.mkdir("base/bin");
        fs::write(base_bin.join("python3.12"), b"").unwrap();
        let base_site = scratch.mkdir("base/lib/python3.12/site-packages");
        let venv_bin = scratch.mkdir("venv/bin");
        std::os::unix::fs::symlink(base_bin.join("python3.12"), venv_bin.join("python3")).unwrap();
        let venv_site = scratch.mkdir("venv/lib/python3.12/site-packages");
        scratch.mkdir("venv/lib/python3.9/site-packages");
        let wheel = venv_site.join("nvidia/nccl/lib/libnccl.so.2");
        let s = LibrarySearch {
            path: vec![scratch.0.join("elsewhere"), venv_bin.clone()],
            ..LibrarySearch::default()
        };
        let found: Vec<Candidate> = s.nccl_candidates();
        let at = |p: &Path| found.iter().position(|c| c.name == p);
        let venv_at = at(&wheel).unwrap_or_else(|| panic!("{wheel:?} not in {found:?}"));
        assert_eq!(found[venv_at].origin, "pip wheel of python3 on PATH");
        let old = at(&scratch
            .0
            .join("venv/lib/python3.9/site-packages/nvidia/nccl/lib/libnccl.so.2"));
        assert!(
            old.is_some_and(|o| o > venv_at),
            "python3.12 before python3.9: {found:?}"
        );
        let base = at(&base_site.join("nvidia/nccl/lib/libnccl.so.2"));
        assert!(
            base.is_some_and(|b| b > venv_at),
            "the venv before its base: {found:?}"
        );

        // The same venv activated: $VIRTUAL_ENV finds it first.
        let s = LibrarySearch {
            virtual_env: Some(scratch.0.join("venv")),
            ..LibrarySearch::default()
        };
        let found = s.nccl_candidates();
        assert_eq!(found[2].name, wheel, "{found:?}");
        assert_eq!(found[2].origin, "pip wheel under $VIRTUAL_ENV");
    }

    #[test]
    fn driver_candidates_skip_stubs_and_dedup() {
        let s = LibrarySearch {
            ld_library_path: vec!["/usr/lib64".into()],
            driver_dirs: vec!["/usr/lib64".into(), "/usr/lib/wsl/lib".into()],
            ..LibrarySearch::default()
        };
        let names: Vec<PathBuf> = s.cuda_driver_candidates().into_iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            vec![
                PathBuf::from("libcuda.so.1"),
                PathBuf::from("libcuda.so"),
                PathBuf::from("/usr/lib64/libcuda.so.1"),
                PathBuf::from("/usr/lib/wsl/lib/libcuda.so.1"),
            ]
        );
        assert!(names.iter().all(|n| !n.to_string_lossy().contains("stubs")));
    }

    #[test]
    fn explicit_driver_library_is_the_only_driver_candidate() {
        let s = LibrarySearch {
            cuda_driver_library: Some("/opt/drv/libcuda.so.1".into()),
            ld_library_path: vec!["/usr/lib64".into()],
            ..LibrarySearch::default()
        };
        assert_eq!(
            s.cuda_driver_candidates(),
            vec![Candidate::new("/opt/drv/libcuda.so.1", "CUDA_DRIVER_LIBRARY")]
        );
    }

    #[test]
    fn bare_names_are_recognised() {
        assert!(Candidate::new("libnccl.so.2", "x").is_bare_name());
        assert!(!Candidate::new("/a/libnccl.so.2", "x").is_bare_name());
        assert!(!Candidate::new("a/libnccl.so.2", "x").is_bare_name());
    }

    #[test]
    fn from_env_always_has_the_standard_candidates() {
        let s = LibrarySearch::from_env();
        let nccl = s.nccl_candidates();
        assert!(!nccl.is_empty());
        if s.nccl_library.is_none() {
            assert_eq!(nccl[0].name, PathBuf::from("libnccl.so.2"));
        }
        assert_eq!(s.cuda_driver_candidates()[0].name, PathBuf::from("libcuda.so.1"));
    }
}
