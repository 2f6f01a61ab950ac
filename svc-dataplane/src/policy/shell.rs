//! The simple commands a shell command line would run, for the tool policy.
//!
//! A hand-written parser of the POSIX shell / bash grammar, as far as a policy needs it: it does
//! not run anything and does not expand variables, it finds every simple command. Sequences
//! (`;` `&&` `||` `&` newlines), pipelines, subshells `( )`, groups `{ }`, `if`/`while`/`for`
//! bodies, command substitution `$( )` and backticks (also inside double quotes and `${ }`),
//! arithmetic `$(( ))` (and `(( ))`, also read as nested subshells, as bash does when it is not
//! arithmetic), process substitution `<( )` `>( )`, here-documents (whose unquoted bodies
//! are expanded by the shell, so their substitutions count too), function bodies. Quotes and
//! escapes are removed (`r""m` and `\rm` are `rm`), ANSI-C strings `$'\x72m'` decoded, leading
//! assignments (`FOO=1 rm`) and redirections dropped. Each simple command is also unwrapped:
//! wrappers that run their arguments as a command (`env`, `command`, `exec`, `nice`, `nohup`,
//! `timeout`, `xargs`, `sudo`, `busybox`, `find -exec`...) give the inner command too, and
//! nested shells (`sh -c '...'`, `bash -c`, `eval`, `su -c`, `env -S`, `watch`) are parsed
//! recursively. A simple command is reported with its program as written and, when that is a
//! path, with the program's basename (`/bin/rm -rf x` gives `/bin/rm -rf x` and `rm -rf x`).
//!
//! What cannot be known without running the line is an [`Opaque`] error, never a guess: an
//! unbalanced quote or parenthesis, a program name computed at run time (`$X -rf`, `$(echo
//! rm)`, a glob or brace expansion `/bin/r?`), a shell that reads its commands from its input
//! (`... | sh`, `bash -s`, `bash <<EOF`), `case` (its `)` patterns are not parsed), `alias`,
//! arrays and extended globs, nesting deeper than [`MAX_DEPTH`]. The policy gives those the
//! strictest decision any shell rule could give.
//!
//! Not seen, by design: what a program does with its arguments or files (`python -c`, `perl
//! -e`, `make`, `git -c alias...`, a script file run by `sh script.sh` or `source`), functions
//! and variables defined by an earlier tool call. A policy is a guard rail for a cooperative
//! model; the sandbox is the boundary.

/// How deep substitutions and nested shells may go before the line is refused as opaque.
pub const MAX_DEPTH: usize = 16;

/// Why a command line cannot be analysed statically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opaque(pub String);

fn opaque<T>(why: impl Into<String>) -> Result<T, Opaque> {
    Err(Opaque(why.into()))
}

/// One word after quote removal.
#[derive(Debug, Clone, Default)]
struct Word {
    /// The text with quotes removed; an expansion stays as written (`$X`, `$(...)`).
    text: String,
    /// Contains an expansion whose value is known only at run time.
    dynamic: bool,
    /// Contains an unquoted glob or brace character (`*`, `?`, `[`, `{`).
    pattern: bool,
    /// Some part of it was quoted or escaped (so it is never a reserved word).
    quoted: bool,
    /// `NAME=...` or `NAME+=...` with the name and `=` unquoted.
    assignment: bool,
}

struct HereDoc {
    delimiter: String,
    quoted: bool,
    strip_tabs: bool,
}

struct Parser<'a> {
    s: &'a [char],
    i: usize,
    depth: usize,
    /// Every simple command found so far, as its words.
    commands: Vec<Vec<Word>>,
    heredocs: Vec<HereDoc>,
}

/// The simple commands `line` runs, each as a string of its words joined by single spaces (see
/// the module documentation), in order of appearance.
pub fn simple_commands(line: &str) -> Result<Vec<String>, Opaque> {
    let chars: Vec<char> = line.chars().collect();
    commands_at(&chars, 0)
}

fn commands_at(chars: &[char], depth: usize) -> Result<Vec<String>, Opaque> {
    if depth > MAX_DEPTH {
        return opaque("nested too deeply");
    }
    let mut p = Parser {
        s: chars,
        i: 0,
        depth,
        commands: vec![],
        heredocs: vec![],
    };
    p.list(None)?;
    let mut out = vec![];
    for words in std::mem::take(&mut p.commands) {
        unwrap_command(&words, depth, &mut out)?;
    }
    Ok(out)
}

fn is_meta(c: char) -> bool {
    matches!(
        c,
        ' ' | '\t' | '\n' | ';' | '&' | '|' | '<' | '>' | '(' | ')'
    )
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_name(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }

    fn peek_at(&self, n: usize) -> Option<char> {
        self.s.get(self.i + n).copied()
    }

    fn nested(&self, inner: &[char]) -> Result<Vec<Vec<Word>>, Opaque> {
        if self.depth + 1 > MAX_DEPTH {
            return opaque("nested too deeply");
        }
        let mut p = Parser {
            s: inner,
            i: 0,
            depth: self.depth + 1,
            commands: vec![],
            heredocs: vec![],
        };
        p.list(None)?;
        Ok(p.commands)
    }

    /// A list of commands up to the end of input or, with `end`, up to its closing `)`.
    fn list(&mut self, end: Option<char>) -> Result<(), Opaque> {
        self.enter()?;
        let r = self.list_inner(end);
        self.depth -= 1;
        r
    }

    fn enter(&mut self) -> Result<(), Opaque> {
        if self.depth >= MAX_DEPTH {
            return opaque("nested too deeply");
        }
        self.depth += 1;
        Ok(())
    }

    fn list_inner(&mut self, end: Option<char>) -> Result<(), Opaque> {
        let mut words: Vec<Word> = vec![];
        loop {
            let Some(c) = self.peek() else {
                self.finish(&mut words);
                if end.is_some() {
                    return opaque("unbalanced parenthesis");
                }
                if !self.heredocs.is_empty() {
                    // A here-document whose body never came: the shell reads nothing more.
                    self.heredocs.clear();
                }
                return Ok(());
            };
            match c {
                ' ' | '\t' => self.i += 1,
                '\\' if self.peek_at(1) == Some('\n') => self.i += 2,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.i += 1;
                    }
                }
                '\n' => {
                    self.i += 1;
                    self.finish(&mut words);
                    self.here_documents()?;
                }
                ';' | '&' | '|' => {
                    self.i += 1;
                    self.finish(&mut words);
                }
                ')' => {
                    self.i += 1;
                    self.finish(&mut words);
                    return match end {
                        Some(_) => Ok(()),
                        None => opaque("unbalanced parenthesis"),
                    };
                }
                '(' => {
                    if words.iter().all(is_reserved) {
                        if self.peek_at(1) == Some('(') {
                            // `(( arithmetic ))`
                            self.i += 2;
                            let mut scratch = Word::default();
                            self.arithmetic(&mut scratch)?;
                        } else {
                            self.i += 1;
                            self.finish(&mut words);
                            self.list(Some(')'))?;
                        }
                    } else if self.rest_starts_with_empty_parens() {
                        // `name () body`: a function definition; its body is a command.
                        while self.peek() != Some(')') {
                            self.i += 1;
                        }
                        self.i += 1;
                        words.clear();
                    } else {
                        return opaque("`(` inside a command (an array or extended glob)");
                    }
                }
                '<' | '>' => self.redirection(&mut words)?,
                _ => {
                    let w = self.word()?;
                    if words.iter().all(is_reserved) && !w.quoted && w.text == "case" {
                        return opaque("`case` is not analysed");
                    }
                    // A number right before `<` or `>` is a file descriptor, not a word.
                    let fd = !w.quoted
                        && !w.text.is_empty()
                        && w.text.chars().all(|c| c.is_ascii_digit())
                        && matches!(self.peek(), Some('<' | '>'));
                    if !fd {
                        words.push(w);
                    }
                }
            }
        }
    }

    fn rest_starts_with_empty_parens(&self) -> bool {
        let mut j = self.i + 1;
        while matches!(self.s.get(j), Some(' ' | '\t')) {
            j += 1;
        }
        self.s.get(j) == Some(&')')
    }

    fn finish(&mut self, words: &mut Vec<Word>) {
        if !words.is_empty() {
            self.commands.push(std::mem::take(words));
        }
    }

    /// `<`, `>`, `>>`, `<>`, `>|`, `<&`, `>&`, `&>` (as `&` then `>`, harmless), `<<<`, `<<`,
    /// `<<-`, and process substitution `<( )` `>( )`, which is a word of the command.
    fn redirection(&mut self, words: &mut Vec<Word>) -> Result<(), Opaque> {
        let c = self.peek().unwrap_or('<');
        if self.peek_at(1) == Some('(') {
            self.i += 2;
            self.list(Some(')'))?;
            words.push(Word {
                text: format!("{c}(...)"),
                dynamic: true,
                ..Word::default()
            });
            return Ok(());
        }
        self.i += 1;
        let mut heredoc = None;
        if c == '<' && self.peek() == Some('<') {
            self.i += 1;
            if self.peek() == Some('<') {
                self.i += 1; // here-string: its word follows
            } else {
                let strip_tabs = self.peek() == Some('-');
                if strip_tabs {
                    self.i += 1;
                }
                heredoc = Some(strip_tabs);
            }
        } else if matches!(self.peek(), Some('>' | '&' | '|')) {
            self.i += 1;
        }
        while matches!(self.peek(), Some(' ' | '\t')) {
            self.i += 1;
        }
        match self.peek() {
            Some('<' | '>') if self.peek_at(1) == Some('(') && heredoc.is_none() => {
                // `< <(cmd)`: the target is a process substitution.
                self.i += 2;
                return self.list(Some(')'));
            }
            None | Some('\n' | ';' | '&' | '|' | '<' | '>' | '(' | ')') => {
                return opaque("a redirection without its target");
            }
            _ => {}
        }
        // The target's own substitutions run; the target is not a word of the command.
        let target = self.word()?;
        if let Some(strip_tabs) = heredoc {
            self.heredocs.push(HereDoc {
                delimiter: target.text,
                quoted: target.quoted,
                strip_tabs,
            });
        }
        Ok(())
    }

    /// Bodies of the here-documents opened on the line just ended.
    fn here_documents(&mut self) -> Result<(), Opaque> {
        for doc in std::mem::take(&mut self.heredocs) {
            let mut body: Vec<char> = vec![];
            loop {
                let start = self.i;
                while self.peek().is_some_and(|c| c != '\n') {
                    self.i += 1;
                }
                let line: String = self.s[start..self.i].iter().collect();
                let at_end = self.peek().is_none();
                if self.peek() == Some('\n') {
                    self.i += 1;
                }
                let cmp = if doc.strip_tabs {
                    line.trim_start_matches('\t')
                } else {
                    line.as_str()
                };
                if cmp == doc.delimiter {
                    break;
                }
                body.extend(line.chars());
                body.push('\n');
                if at_end {
                    break;
                }
            }
            if !doc.quoted {
                // Unquoted: the body is expanded like a double-quoted string.
                let mut p = Parser {
                    s: &body,
                    i: 0,
                    depth: self.depth,
                    commands: vec![],
                    heredocs: vec![],
                };
                let mut scratch = Word::default();
                p.double_quoted_until(&mut scratch, None)?;
                self.commands.append(&mut p.commands);
            }
        }
        Ok(())
    }

    /// One word, up to an unquoted metacharacter.
    fn word(&mut self) -> Result<Word, Opaque> {
        let mut w = Word::default();
        // Whether the word so far is a valid assignment name (unquoted identifier chars).
        let mut name_so_far = true;
        // Unquoted glob and brace characters, in order.
        let mut specials = String::new();
        while let Some(c) = self.peek() {
            if is_meta(c) {
                if c == '(' && w.assignment && w.text.ends_with('=') {
                    return opaque("an array assignment");
                }
                break;
            }
            let plain_name = if w.text.is_empty() {
                is_name_start(c)
            } else {
                is_name(c)
            };
            if c == '=' && name_so_far && !w.text.is_empty() && !w.assignment {
                w.assignment = true;
            } else if c == '+'
                && self.peek_at(1) == Some('=')
                && name_so_far
                && !w.text.is_empty()
                && !w.assignment
            {
                w.text.push('+');
                self.i += 1;
                w.assignment = true;
                w.text.push('=');
                self.i += 1;
                continue;
            } else if !plain_name {
                name_so_far = false;
            }
            match c {
                '\\' => {
                    self.i += 1;
                    match self.peek() {
                        Some('\n') => {
                            self.i += 1;
                        }
                        Some(n) => {
                            w.text.push(n);
                            w.quoted = true;
                            name_so_far = false;
                            self.i += 1;
                        }
                        None => {
                            w.quoted = true;
                        }
                    }
                }
                '\'' => {
                    self.i += 1;
                    w.quoted = true;
                    name_so_far = false;
                    loop {
                        match self.peek() {
                            None => return opaque("unbalanced single quote"),
                            Some('\'') => {
                                self.i += 1;
                                break;
                            }
                            Some(ch) => {
                                w.text.push(ch);
                                self.i += 1;
                            }
                        }
                    }
                }
                '"' => {
                    self.i += 1;
                    w.quoted = true;
                    name_so_far = false;
                    self.double_quoted_until(&mut w, Some('"'))?;
                }
                '$' => {
                    name_so_far = false;
                    self.dollar(&mut w, false)?;
                }
                '`' => {
                    name_so_far = false;
                    self.backtick(&mut w)?;
                }
                '*' | '?' | '[' | '{' | ']' | '}' | ',' | '.' => {
                    if matches!(c, '?' | '*') && self.peek_at(1) == Some('(') {
                        return opaque("an extended glob");
                    }
                    specials.push(c);
                    w.text.push(c);
                    self.i += 1;
                }
                '@' | '!' | '+' if self.peek_at(1) == Some('(') => {
                    return opaque("an extended glob");
                }
                _ => {
                    w.text.push(c);
                    self.i += 1;
                }
            }
        }
        w.pattern = is_pattern(&specials);
        Ok(w)
    }

    /// Inside double quotes (or an unquoted here-document body when `close` is None).
    fn double_quoted_until(&mut self, w: &mut Word, close: Option<char>) -> Result<(), Opaque> {
        loop {
            match self.peek() {
                None if close.is_none() => return Ok(()),
                None => return opaque("unbalanced double quote"),
                Some(c) if Some(c) == close => {
                    self.i += 1;
                    return Ok(());
                }
                Some('\\') => {
                    self.i += 1;
                    match self.peek() {
                        Some('\n') => self.i += 1,
                        Some(n @ ('$' | '`' | '"' | '\\')) => {
                            w.text.push(n);
                            self.i += 1;
                        }
                        Some(n) => {
                            w.text.push('\\');
                            w.text.push(n);
                            self.i += 1;
                        }
                        None if close.is_none() => w.text.push('\\'),
                        None => return opaque("unbalanced double quote"),
                    }
                }
                Some('$') => self.dollar(w, true)?,
                Some('`') => self.backtick(w)?,
                Some(c) => {
                    w.text.push(c);
                    self.i += 1;
                }
            }
        }
    }

    /// `$...` at the cursor: `$( )`, `$(( ))`, `${ }`, `$'...'`, `$"..."`, `$name`, `$1`, `$@`.
    fn dollar(&mut self, w: &mut Word, in_double_quotes: bool) -> Result<(), Opaque> {
        let start = self.i;
        self.i += 1;
        match self.peek() {
            Some('(') if self.peek_at(1) == Some('(') => {
                self.i += 2;
                self.arithmetic(w)?;
                w.dynamic = true;
                w.text.push_str("$((...))");
            }
            Some('(') => {
                self.i += 1;
                self.list(Some(')'))?;
                w.dynamic = true;
                w.text.push_str("$(...)");
            }
            Some('{') => {
                self.i += 1;
                self.braced_parameter()?;
                w.dynamic = true;
                w.text.extend(&self.s[start..self.i]);
            }
            Some('\'') if !in_double_quotes => {
                self.i += 1;
                w.quoted = true;
                self.ansi_c(w)?;
            }
            Some('"') if !in_double_quotes => {
                self.i += 1;
                w.quoted = true;
                self.double_quoted_until(w, Some('"'))?;
            }
            Some(c) if is_name_start(c) => {
                while self.peek().is_some_and(is_name) {
                    self.i += 1;
                }
                w.dynamic = true;
                w.text.extend(&self.s[start..self.i]);
            }
            Some(c) if c.is_ascii_digit() || "@*#?$!-".contains(c) => {
                self.i += 1;
                w.dynamic = true;
                w.text.extend(&self.s[start..self.i]);
            }
            _ => w.text.push('$'),
        }
        Ok(())
    }

    /// After `$((` or `((`: up to the matching `))`; substitutions inside run. What bash cannot
    /// read as arithmetic it runs as nested subshells: the text is read so too.
    fn arithmetic(&mut self, w: &mut Word) -> Result<(), Opaque> {
        let start = self.i;
        self.arithmetic_only(w)?;
        let inner = &self.s[start..self.i - 2];
        if let Ok(mut found) = self.nested(inner) {
            self.commands.append(&mut found);
        }
        Ok(())
    }

    fn arithmetic_only(&mut self, w: &mut Word) -> Result<(), Opaque> {
        let mut depth = 0usize;
        loop {
            match self.peek() {
                None => return opaque("unbalanced arithmetic"),
                Some(')') if depth == 0 => {
                    if self.peek_at(1) != Some(')') {
                        return opaque("unbalanced arithmetic");
                    }
                    self.i += 2;
                    return Ok(());
                }
                Some(')') => {
                    depth -= 1;
                    self.i += 1;
                }
                Some('(') => {
                    depth += 1;
                    self.i += 1;
                }
                Some('$') => {
                    let mut inner = Word::default();
                    self.dollar(&mut inner, true)?;
                }
                Some('`') => self.backtick(w)?,
                Some('\'' | '"') => return opaque("quotes inside arithmetic"),
                Some(_) => self.i += 1,
            }
        }
    }

    /// After `${`: up to the matching `}`; substitutions inside run.
    fn braced_parameter(&mut self) -> Result<(), Opaque> {
        self.enter()?;
        let r = self.braced_parameter_inner();
        self.depth -= 1;
        r
    }

    fn braced_parameter_inner(&mut self) -> Result<(), Opaque> {
        let mut scratch = Word::default();
        loop {
            match self.peek() {
                None => return opaque("unbalanced ${"),
                Some('}') => {
                    self.i += 1;
                    return Ok(());
                }
                Some('\\') => self.i += 2,
                Some('\'') => {
                    self.i += 1;
                    while self.peek().is_some_and(|c| c != '\'') {
                        self.i += 1;
                    }
                    if self.peek().is_none() {
                        return opaque("unbalanced single quote");
                    }
                    self.i += 1;
                }
                Some('"') => {
                    self.i += 1;
                    self.double_quoted_until(&mut scratch, Some('"'))?;
                }
                Some('$') => self.dollar(&mut scratch, true)?,
                Some('`') => self.backtick(&mut scratch)?,
                Some(_) => self.i += 1,
            }
        }
    }

    /// `` `...` ``: the old command substitution; `\` escapes `` ` ``, `\` and `$` inside.
    fn backtick(&mut self, w: &mut Word) -> Result<(), Opaque> {
        self.i += 1;
        let mut inner: Vec<char> = vec![];
        loop {
            match self.peek() {
                None => return opaque("unbalanced backquote"),
                Some('`') => {
                    self.i += 1;
                    break;
                }
                Some('\\') => {
                    self.i += 1;
                    match self.peek() {
                        Some(n @ ('`' | '\\' | '$')) => inner.push(n),
                        Some(n) => {
                            inner.push('\\');
                            inner.push(n);
                        }
                        None => return opaque("unbalanced backquote"),
                    }
                    self.i += 1;
                }
                Some(c) => {
                    inner.push(c);
                    self.i += 1;
                }
            }
        }
        let mut found = self.nested(&inner)?;
        self.commands.append(&mut found);
        w.dynamic = true;
        w.text.push_str("`...`");
        Ok(())
    }

    /// After `$'`: ANSI-C quoting, decoded.
    fn ansi_c(&mut self, w: &mut Word) -> Result<(), Opaque> {
        loop {
            match self.peek() {
                None => return opaque("unbalanced $'"),
                Some('\'') => {
                    self.i += 1;
                    return Ok(());
                }
                Some('\\') => {
                    self.i += 1;
                    let Some(e) = self.peek() else {
                        return opaque("unbalanced $'");
                    };
                    self.i += 1;
                    match e {
                        'n' => w.text.push('\n'),
                        't' => w.text.push('\t'),
                        'r' => w.text.push('\r'),
                        'a' => w.text.push('\x07'),
                        'b' => w.text.push('\x08'),
                        'e' | 'E' => w.text.push('\x1b'),
                        'f' => w.text.push('\x0c'),
                        'v' => w.text.push('\x0b'),
                        'x' | 'u' | 'U' => {
                            let max = match e {
                                'x' => 2,
                                'u' => 4,
                                _ => 8,
                            };
                            let mut v = 0u32;
                            let mut n = 0;
                            while n < max {
                                let Some(d) = self.peek().and_then(|c| c.to_digit(16)) else {
                                    break;
                                };
                                v = v * 16 + d;
                                n += 1;
                                self.i += 1;
                            }
                            if n == 0 {
                                w.text.push('\\');
                                w.text.push(e);
                            } else {
                                match char::from_u32(v) {
                                    Some(ch) => w.text.push(ch),
                                    None => return opaque("an invalid character escape"),
                                }
                            }
                        }
                        '0'..='7' => {
                            let mut v = e.to_digit(8).unwrap_or(0);
                            let mut n = 1;
                            while n < 3 {
                                let Some(d) = self.peek().and_then(|c| c.to_digit(8)) else {
                                    break;
                                };
                                v = v * 8 + d;
                                n += 1;
                                self.i += 1;
                            }
                            match char::from_u32(v) {
                                Some(ch) => w.text.push(ch),
                                None => return opaque("an invalid character escape"),
                            }
                        }
                        'c' => return opaque("a control-character escape"),
                        other => {
                            if !matches!(other, '\\' | '\'' | '"' | '?') {
                                w.text.push('\\');
                            }
                            w.text.push(other);
                        }
                    }
                }
                Some(c) => {
                    w.text.push(c);
                    self.i += 1;
                }
            }
        }
    }
}

/// Whether unquoted `specials` (in order) make a glob (`*`, `?`, `[...]`) or a brace expansion
/// (`{a,b}`, `{1..3}`). `[` alone (the test command) and `{}` are neither.
fn is_pattern(specials: &str) -> bool {
    if specials.contains(['*', '?']) {
        return true;
    }
    if let Some(open) = specials.find('[')
        && specials[open + 1..].contains(']')
    {
        return true;
    }
    if let Some(open) = specials.find('{') {
        let after = &specials[open + 1..];
        if let Some(close) = after.rfind('}') {
            let inside = &after[..close];
            return inside.contains(',') || inside.contains("..");
        }
    }
    false
}

fn is_reserved(w: &Word) -> bool {
    !w.quoted
        && matches!(
            w.text.as_str(),
            "!" | "{"
                | "}"
                | "if"
                | "then"
                | "else"
                | "elif"
                | "fi"
                | "do"
                | "done"
                | "while"
                | "until"
                | "coproc"
        )
}

fn join(words: &[Word]) -> String {
    words
        .iter()
        .map(|w| w.text.as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

fn basename(program: &str) -> &str {
    program.rsplit('/').next().unwrap_or(program)
}

/// The shells whose `-c` string is parsed.
const SHELLS: &[&str] = &[
    "sh", "bash", "dash", "zsh", "ksh", "ash", "mksh", "yash", "posh", "rbash", "fish", "ksh93",
    "pdksh", "oksh", "loksh",
];

/// Reports `words` (one simple command) and every command it runs through a wrapper or a
/// nested shell into `out`.
fn unwrap_command(words: &[Word], depth: usize, out: &mut Vec<String>) -> Result<(), Opaque> {
    if depth > MAX_DEPTH {
        return opaque("nested too deeply");
    }
    let mut rest = words;
    // Reserved words that open or close a compound command, and `function NAME`.
    loop {
        match rest.first() {
            Some(w) if is_reserved(w) => rest = &rest[1..],
            Some(w) if !w.quoted && w.text == "function" => {
                rest = &rest[rest.len().min(2)..];
            }
            Some(w) if !w.quoted && matches!(w.text.as_str(), "for" | "select") => return Ok(()),
            _ => break,
        }
    }
    // `time -p` and assignments before the program.
    while let Some(w) = rest.first() {
        if w.assignment {
            rest = &rest[1..];
        } else {
            break;
        }
    }
    let Some(program) = rest.first() else {
        return Ok(());
    };
    if program.dynamic {
        return opaque(format!(
            "the program `{}` is computed when the line runs",
            program.text
        ));
    }
    if program.pattern {
        return opaque(format!(
            "the program `{}` is a glob or brace expansion",
            program.text
        ));
    }
    let text = join(rest);
    let name = basename(&program.text).to_string();
    out.push(text.clone());
    if name != program.text {
        let mut short = vec![name.clone()];
        short.extend(rest[1..].iter().map(|w| w.text.clone()));
        out.push(short.join(" "));
    }
    let args = &rest[1..];
    let nested = |s: &str, out: &mut Vec<String>| -> Result<(), Opaque> {
        let chars: Vec<char> = s.chars().collect();
        out.extend(commands_at(&chars, depth + 1)?);
        Ok(())
    };
    let inner = |from: usize, out: &mut Vec<String>| -> Result<(), Opaque> {
        match args.get(from..) {
            Some(r) if !r.is_empty() => unwrap_command(r, depth + 1, out),
            _ => Ok(()),
        }
    };
    let static_text = |w: &Word| -> Result<String, Opaque> {
        if w.dynamic {
            opaque(format!(
                "the command string `{}` is computed when the line runs",
                w.text
            ))
        } else {
            Ok(w.text.clone())
        }
    };
    if SHELLS.contains(&name.as_str()) {
        return shell_arguments(args, |s| nested(s, out), static_text);
    }
    match name.as_str() {
        "eval" => {
            let mut parts = vec![];
            for a in args {
                parts.push(static_text(a)?);
            }
            nested(&parts.join(" "), out)?;
        }
        "env" => {
            let mut j = 0;
            while let Some(a) = args.get(j) {
                let t = a.text.as_str();
                if t == "-S" || t == "--split-string" {
                    let s = args.get(j + 1).map(static_text).transpose()?;
                    let mut parts = vec![s.unwrap_or_default()];
                    for w in args.iter().skip(j + 2) {
                        parts.push(static_text(w)?);
                    }
                    return nested(&parts.join(" "), out);
                } else if let Some(s) = t
                    .strip_prefix("--split-string=")
                    .or_else(|| t.strip_prefix("-S").filter(|s| !s.is_empty()))
                {
                    let mut parts = vec![static_text(a).map(|_| s.to_string())?];
                    for w in args.iter().skip(j + 1) {
                        parts.push(static_text(w)?);
                    }
                    return nested(&parts.join(" "), out);
                } else if matches!(t, "-u" | "-C" | "--unset" | "--chdir") {
                    j += 2;
                } else if t == "--" {
                    j += 1;
                    break;
                } else if t.starts_with('-') || a.assignment {
                    j += 1;
                } else {
                    break;
                }
            }
            inner(j, out)?;
        }
        "command" | "builtin" | "nohup" | "unbuffer" | "exec" | "nice" | "setsid" | "stdbuf"
        | "time" | "ionice" | "doas" | "sudo" | "strace" | "ltrace" | "catchsegv" | "fakeroot"
        | "proxychains" | "torsocks" | "firejail" | "bwrap" | "unshare" | "nsenter"
        | "systemd-run" | "runuser" | "chpst" | "caffeinate" => {
            let with_arg: &str = match name.as_str() {
                "exec" => "a",
                "nice" => "n",
                "stdbuf" => "ioe",
                "time" => "fo",
                "ionice" => "cnp",
                "doas" => "uC",
                "sudo" => "ugpCDhrtTRU",
                "strace" => "eopsuEIbPXS",
                "ltrace" => "eopsuEnSAaDFlxL",
                "runuser" => "ugGwc",
                "nsenter" => "tSGw",
                "chpst" => "ugUe/n",
                _ => "",
            };
            // `su -c` / `runuser -c`: a shell string.
            if name == "runuser"
                && let Some(c) = args.iter().position(|w| w.text == "-c")
            {
                if let Some(s) = args.get(c + 1) {
                    nested(&static_text(s)?, out)?;
                }
                return Ok(());
            }
            let j = skip_options(args, with_arg, &[]);
            inner(j, out)?;
        }
        "su" => {
            if let Some(c) = args
                .iter()
                .position(|w| w.text == "-c" || w.text == "--command")
                && let Some(s) = args.get(c + 1)
            {
                nested(&static_text(s)?, out)?;
            } else if let Some(s) = args.iter().find_map(|w| w.text.strip_prefix("--command=")) {
                nested(s, out)?;
            }
        }
        "timeout" => {
            let j = skip_options(args, "sk", &["--signal", "--kill-after"]);
            inner(j + 1, out)?;
        }
        "chroot" | "taskset" | "flock" | "chrt" => {
            if name == "flock"
                && let Some(c) = args
                    .iter()
                    .position(|w| w.text == "-c" || w.text == "--command")
            {
                if let Some(s) = args.get(c + 1) {
                    nested(&static_text(s)?, out)?;
                }
                return Ok(());
            }
            let with_arg = if name == "flock" { "wE" } else { "" };
            let j = skip_options(args, with_arg, &["--userspec", "--groups", "--timeout"]);
            inner(j + 1, out)?;
        }
        "xargs" => {
            let j = skip_options(
                args,
                "IinPdEeLlsa",
                &[
                    "--arg-file",
                    "--delimiter",
                    "--eof",
                    "--replace",
                    "--max-lines",
                    "--max-args",
                    "--max-procs",
                    "--max-chars",
                    "--process-slot-var",
                ],
            );
            inner(j, out)?;
        }
        "busybox" | "toybox" => inner(0, out)?,
        "watch" => {
            let j = skip_options(args, "nq", &["--interval", "--differences"]);
            let exec = args[..j]
                .iter()
                .any(|w| w.text == "-x" || w.text == "--exec");
            if exec {
                inner(j, out)?;
            } else {
                let mut parts = vec![];
                for a in &args[j.min(args.len())..] {
                    parts.push(static_text(a)?);
                }
                nested(&parts.join(" "), out)?;
            }
        }
        "script" => {
            if let Some(c) = args
                .iter()
                .position(|w| w.text == "-c" || w.text == "--command")
                && let Some(s) = args.get(c + 1)
            {
                nested(&static_text(s)?, out)?;
            }
        }
        "find" => {
            let mut j = 0;
            while j < args.len() {
                if matches!(
                    args[j].text.as_str(),
                    "-exec" | "-execdir" | "-ok" | "-okdir"
                ) {
                    let end = args[j + 1..]
                        .iter()
                        .position(|w| w.text == ";" || w.text == "+")
                        .map(|p| j + 1 + p)
                        .unwrap_or(args.len());
                    if end > j + 1 {
                        unwrap_command(&args[j + 1..end], depth + 1, out)?;
                    }
                    j = end;
                }
                j += 1;
            }
        }
        "alias" => return opaque("`alias` changes what later commands mean"),
        _ => {}
    }
    Ok(())
}

/// The arguments of a shell: `-c STRING` is parsed; a shell with no script reads its commands
/// from its input, which the line does not show.
fn shell_arguments(
    args: &[Word],
    mut nested: impl FnMut(&str) -> Result<(), Opaque>,
    static_text: impl Fn(&Word) -> Result<String, Opaque>,
) -> Result<(), Opaque> {
    let mut j = 0;
    let mut command_string = false;
    while let Some(a) = args.get(j) {
        let t = a.text.as_str();
        if t == "--" {
            j += 1;
            break;
        }
        if t == "-" {
            j += 1;
            break;
        }
        if matches!(t, "-o" | "+o" | "-O" | "+O" | "--rcfile" | "--init-file") {
            j += 2;
            continue;
        }
        if t.starts_with("--") {
            j += 1;
            continue;
        }
        if (t.starts_with('-') || t.starts_with('+')) && t.len() > 1 {
            if t[1..].contains('c') {
                command_string = true;
            }
            if t[1..].contains('s') {
                return opaque("a shell reading its commands from its input");
            }
            j += 1;
            continue;
        }
        break;
    }
    match (command_string, args.get(j)) {
        (true, Some(s)) => nested(&static_text(s)?),
        (true, None) => opaque("`-c` without its command string"),
        // A script file: what it runs is not on this line.
        (false, Some(_)) => Ok(()),
        (false, None) => opaque("a shell reading its commands from its input"),
    }
}

/// The index of the first operand after the options of a wrapper. `with_arg`: short options
/// that take an argument; `long_with_arg`: long options that take one when not written `=`.
fn skip_options(args: &[Word], with_arg: &str, long_with_arg: &[&str]) -> usize {
    let mut j = 0;
    while let Some(a) = args.get(j) {
        let t = a.text.as_str();
        if t == "--" {
            return j + 1;
        }
        if let Some(long) = t.strip_prefix("--") {
            j += 1;
            if !long.contains('=') && long_with_arg.contains(&t) {
                j += 1;
            }
            continue;
        }
        if t.len() > 1 && t.starts_with('-') {
            j += 1;
            let letters: Vec<char> = t[1..].chars().collect();
            for (k, l) in letters.iter().enumerate() {
                if with_arg.contains(*l) {
                    if k + 1 == letters.len() {
                        j += 1; // the argument is the next word
                    }
                    break;
                }
            }
            continue;
        }
        if a.assignment {
            // `sudo FOO=1 cmd`, `doas FOO=1 cmd`.
            j += 1;
            continue;
        }
        break;
    }
    j.min(args.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cmds(line: &str) -> Vec<String> {
        simple_commands(line).unwrap_or_else(|e| panic!("{line:?}: {e:?}"))
    }

    fn runs_rm(line: &str) -> bool {
        cmds(line).iter().any(|c| c == "rm -rf x")
    }

    #[test]
    fn every_simple_command_of_a_line_is_found() {
        for line in [
            "rm -rf x",
            "cd . && rm -rf x",
            "cd . || rm -rf x",
            "cd . ; rm -rf x",
            "cd .\nrm -rf x",
            "true & rm -rf x",
            "ls | rm -rf x",
            "ls |& rm -rf x",
            "(rm -rf x)",
            "( cd / ; (rm -rf x) )",
            "{ rm -rf x; }",
            "echo $(rm -rf x)",
            "echo \"$(rm -rf x)\"",
            "echo `rm -rf x`",
            "echo \"`rm -rf x`\"",
            "echo \"a $(echo \"$(rm -rf x)\") b\"",
            "cat <(rm -rf x)",
            "tee >(rm -rf x)",
            "cat < <(rm -rf x)",
            "/bin/rm -rf x",
            "/usr/bin/../bin/rm -rf x",
            "./rm -rf x",
            "FOO=1 rm -rf x",
            "FOO=1 BAR=\"a b\" rm -rf x",
            "r\"\"m -rf x",
            "\\rm -rf x",
            "'rm' -rf x",
            "\"r\"'m' -rf x",
            "$'\\x72m' -rf x",
            "$'\\162m' -rf x",
            "env rm -rf x",
            "env -i FOO=1 -u BAR rm -rf x",
            "env -S 'rm -rf x'",
            "command rm -rf x",
            "command -p rm -rf x",
            "builtin exec rm -rf x",
            "exec rm -rf x",
            "exec -a foo rm -rf x",
            "nice rm -rf x",
            "nice -n 10 rm -rf x",
            "nohup rm -rf x",
            "timeout 5 rm -rf x",
            "timeout -s KILL 5s rm -rf x",
            "echo x | xargs rm -rf x",
            "xargs -I{} -n 1 rm -rf x",
            "sudo rm -rf x",
            "sudo -u nobody -E rm -rf x",
            "busybox rm -rf x",
            "stdbuf -oL rm -rf x",
            "setsid rm -rf x",
            "time rm -rf x",
            "! rm -rf x",
            "sh -c 'rm -rf x'",
            "sh -c \"rm -rf x\"",
            "bash -c 'cd . && rm -rf x'",
            "bash -ec 'rm -rf x'",
            "bash -o pipefail -c 'rm -rf x'",
            "/bin/sh -c 'sh -c \"rm -rf x\"'",
            "eval 'rm -rf x'",
            "eval rm -rf x",
            "su -c 'rm -rf x'",
            "watch -n 1 rm -rf x",
            "find . -exec rm -rf x \\;",
            "find . -name y -execdir rm -rf x +",
            "if true; then rm -rf x; fi",
            "if false; then :; else rm -rf x; fi",
            "while true; do rm -rf x; done",
            "for f in a; do rm -rf x; done",
            "f() { rm -rf x; }; f",
            "function f { rm -rf x; }",
            "echo ${X:-$(rm -rf x)}",
            "echo $((1 + $(rm -rf x)))",
            "cat > out <<EOF\n$(rm -rf x)\nEOF",
            "echo hi > $(rm -rf x)",
            "x=$(rm -rf x) true",
            "ls # comment\nrm -rf x",
            "r\\\nm -rf x",
            "echo a;rm -rf x",
            "echo a&&rm -rf x",
            "2>/dev/null rm -rf x",
            "rm -rf x 2>&1 >/dev/null",
        ] {
            assert!(runs_rm(line), "{line:?} gave {:?}", simple_commands(line));
        }
    }

    #[test]
    fn what_is_only_data_is_not_a_command() {
        for line in [
            "echo 'rm -rf x'",
            "echo \"rm -rf x\"",
            "echo rm -rf x",
            "echo '$(rm -rf x)'",
            "grep -r 'rm -rf x' .",
            "cat > out <<'EOF'\n$(rm -rf x)\nEOF",
            "# rm -rf x",
            "printf '%s' \"\\$(rm -rf x)\"",
        ] {
            assert!(!runs_rm(line), "{line:?} gave {:?}", simple_commands(line));
        }
        assert_eq!(cmds("echo hi"), ["echo hi"]);
        assert_eq!(
            cmds("cd /tmp && ls -l | wc -l"),
            ["cd /tmp", "ls -l", "wc -l"]
        );
        assert_eq!(cmds("/bin/ls"), ["/bin/ls", "ls"]);
        assert_eq!(cmds(""), Vec::<String>::new());
        assert_eq!(cmds("a=1"), Vec::<String>::new());
        assert_eq!(
            cmds("cat > f.txt <<'EOF'\nline (1)\n`x`\nEOF\nls"),
            ["cat", "ls"]
        );
    }

    #[test]
    fn what_cannot_be_known_is_opaque() {
        for line in [
            "echo 'unbalanced",
            "echo \"unbalanced",
            "echo $(unbalanced",
            "(unbalanced",
            "unbalanced)",
            "echo `unbalanced",
            "$X -rf x",
            "$(echo rm) -rf x",
            "`echo rm` -rf x",
            "\"$CMD\" -rf x",
            "/bin/r? -rf x",
            "/bin/r* -rf x",
            "{rm,-rf,x}",
            "echo rm -rf x | sh",
            "echo rm -rf x | bash -s",
            "bash <<EOF\nrm -rf x\nEOF",
            "sh -c \"$CMD\"",
            "eval \"$CMD\"",
            "case a in a) rm -rf x;; esac",
            "alias r=rm",
            "a=(1 2)",
            "sudo $CMD",
            "env $CMD",
            "xargs $CMD",
            "ls @(a|b)",
            "echo \\$(rm -rf x)",
        ] {
            assert!(
                simple_commands(line).is_err(),
                "{line:?} gave {:?}",
                simple_commands(line)
            );
        }
        let deep = format!("{}rm -rf x{}", "$(".repeat(40), ")".repeat(40));
        assert!(simple_commands(&deep).is_err());
        let deep = format!("{}rm -rf x", "eval ".repeat(40));
        assert!(simple_commands(&deep).is_err());
    }

    /// A word that the shell reads as itself.
    fn plain_word() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9_./-]{1,8}".prop_filter("not reserved", |w| {
            !matches!(
                w.as_str(),
                "if" | "then"
                    | "else"
                    | "elif"
                    | "fi"
                    | "do"
                    | "done"
                    | "while"
                    | "until"
                    | "time"
                    | "coproc"
                    | "case"
                    | "for"
                    | "select"
                    | "function"
                    | "alias"
                    | "eval"
            ) && !w.starts_with('-')
                && !w.contains('/')
                && !SHELLS.contains(&w.as_str())
        })
    }

    /// Ways to hide `inner` in a longer line.
    fn wrap(inner: String, before: String, how: u8) -> String {
        match how % 14 {
            0 => format!("{before} && {inner}"),
            1 => format!("{before}; {inner}"),
            2 => format!("{before} | {inner}"),
            // Spaced here and below: `((` and `$((` open arithmetic, not nested subshells.
            3 => format!("( {inner} )"),
            4 => format!("{{ {inner}; }}"),
            5 => format!("{before} \"$( {inner} )\""),
            6 => format!("{before} `{inner}`"),
            7 => format!("sh -c '{inner}'"),
            8 => format!("env A=1 {inner}"),
            9 => format!("sudo -u nobody {inner}"),
            10 => format!("timeout 5 {inner}"),
            11 => format!("{before} || {inner}"),
            12 => format!("if {before}; then {inner}; fi"),
            _ => format!("{before} <( {inner} )"),
        }
    }

    proptest! {
        #[test]
        fn the_parser_never_panics(line in "\\PC{0,80}") {
            let _ = simple_commands(&line);
        }

        #[test]
        fn the_parser_never_panics_on_shell_punctuation(line in "[a-z $()`'\"\\\\;&|<>{}\n#=*?-]{0,60}") {
            let _ = simple_commands(&line);
        }

        #[test]
        fn plain_words_are_one_command(words in prop::collection::vec(plain_word(), 1..6)) {
            let line = words.join(" ");
            prop_assert_eq!(simple_commands(&line).unwrap(), vec![line.clone()]);
        }

        #[test]
        fn a_hidden_command_is_still_found(
            before in prop::collection::vec(plain_word(), 1..4),
            hows in prop::collection::vec(any::<u8>(), 1..4),
        ) {
            let mut line = "rm -rf x".to_string();
            for how in hows {
                // Single quotes do not nest: only wrap in `sh -c '...'` a line without them.
                let how = if how % 14 == 7 && line.contains('\'') { 0 } else { how };
                // Backquotes do not nest unescaped.
                let how = if how % 14 == 6 && line.contains('`') { 1 } else { how };
                // Wrappers run a simple command, not a compound one.
                let how = if (8..=10).contains(&(how % 14)) && !line.starts_with("rm ") {
                    1
                } else {
                    how
                };
                line = wrap(line, before.join(" "), how);
            }
            let found = simple_commands(&line);
            prop_assert!(
                found.as_ref().is_ok_and(|c| c.iter().any(|c| c == "rm -rf x")),
                "{:?} gave {:?}", line, found
            );
        }
    }
}
