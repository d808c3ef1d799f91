//! Python's `strftime` for the few codes chat templates use (`strftime_now("%d %b %Y")` in Llama 3.2's and 3.3's),
//! on a UTC time: a code it does not know is an error, not a guess.

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// The civil date of day `days` since 1970-01-01 (proleptic Gregorian): year, month 1–12, day 1–31.
fn civil(days: i64) -> (i64, usize, u32) {
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as usize;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `format` for the UTC time `secs` seconds after the epoch.
pub fn strftime(secs: u64, format: &str) -> Result<String, String> {
    let days = (secs / 86_400) as i64;
    let (year, month, day) = civil(days);
    let in_day = secs % 86_400;
    let weekday = DAYS[(days + 3).rem_euclid(7) as usize];
    let day_of_year = days - january_first(year) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let code = chars.next().ok_or("strftime: a format ends with `%`")?;
        let piece = match code {
            'd' => format!("{day:02}"),
            'e' => format!("{day:2}"),
            'm' => format!("{month:02}"),
            'b' => MONTHS[month - 1][..3].to_string(),
            'B' => MONTHS[month - 1].to_string(),
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'a' => weekday[..3].to_string(),
            'A' => weekday.to_string(),
            'j' => format!("{day_of_year:03}"),
            'H' => format!("{:02}", in_day / 3600),
            'M' => format!("{:02}", in_day % 3600 / 60),
            'S' => format!("{:02}", in_day % 60),
            '%' => "%".to_string(),
            other => return Err(format!("strftime: `%{other}` is not supported")),
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Days from 1970-01-01 to January 1st of `year` (the inverse of [`civil`] there: in a year counted from March,
/// January 1st is day 306 of the year before).
fn january_first(year: i64) -> i64 {
    let y = year - 1;
    let (era, yoe) = (y.div_euclid(400), y.rem_euclid(400));
    era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + 306 - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_format_as_python_formats_them() {
        // 2024-07-26 12:34:56 UTC, a Friday (Llama 3.1's default date_string is "26 Jul 2024").
        let t = 1_721_997_296;
        assert_eq!(strftime(t, "%d %b %Y").as_deref(), Ok("26 Jul 2024"));
        assert_eq!(strftime(t, "%Y-%m-%d %H:%M:%S").as_deref(), Ok("2024-07-26 12:34:56"));
        assert_eq!(strftime(t, "%A, %B %e (%j), %a %y %%").as_deref(), Ok("Friday, July 26 (208), Fri 24 %"));
        assert_eq!(strftime(0, "%d %b %Y %A").as_deref(), Ok("01 Jan 1970 Thursday"));
        // A leap day, and the last day of a leap year.
        assert_eq!(strftime(951_782_400, "%Y-%m-%d %j").as_deref(), Ok("2000-02-29 060"));
        assert_eq!(strftime(1_735_603_200, "%Y-%m-%d %j").as_deref(), Ok("2024-12-31 366"));
        assert!(strftime(t, "%Q").is_err() && strftime(t, "50%").is_err());
    }
}
