//! Scripted model server (see README in this crate).
