//! What `perch-bench` shares with the workspace's tests: the headless-browser driver.

pub mod browser;
