// `sqlx::migrate!` embeds the migrations at compile time: a new or changed file must rebuild.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
