//! The router's checks of an OpenAI request body: any bytes give a checked request or an `ApiError`, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let _ = router::http::openai::check_chat(body);
    let _ = router::http::openai::check_completion(body);
});
