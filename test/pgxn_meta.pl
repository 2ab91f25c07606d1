#!/usr/bin/perl
# Check a META.json against the PGXN Meta Spec 1.0 (https://pgxn.org/meta/spec.txt):
# the required keys, the type and format of every key the spec defines, no
# keys it does not define (other than x_ custom keys), and that the files
# named by "provides" exist.  Debian packages no PGXN validator
# (PGXN::Meta::Validator is on CPAN only), hence this script.
#
#   perl test/pgxn_meta.pl [META.json]      prints the errors, exits 1 if any
use strict;
use warnings;
use JSON::PP;
use File::Basename qw(dirname);

my $file = shift // 'META.json';
my $dir = dirname($file);
my @errors;
sub err { push @errors, join('', @_) }

open my $fh, '<', $file or die "$file: $!\n";
my $meta = eval { JSON::PP->new->utf8->decode(do { local $/; <$fh> }) };
die "$file is not valid JSON: $@" unless $meta;
die "$file: the top level is not an object\n" unless ref $meta eq 'HASH';

my $semver = qr/(?:0|[1-9]\d*)\.(?:0|[1-9]\d*)\.(?:0|[1-9]\d*)
	(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?/x;
my %license = map { $_ => 1 } qw(agpl_3 apache_1_1 apache_2_0 artistic_1
	artistic_2 bsd freebsd gfdl_1_2 gfdl_1_3 gpl_1 gpl_2 gpl_3 lgpl_2_1 lgpl_3_0
	mit mozilla_1_0 mozilla_1_1 openssl perl_5 postgresql qpl_1_0 ssleay sun
	zlib open_source restricted unrestricted unknown);

sub is_string { defined $_[0] && !ref $_[0] }
sub custom { $_[0] =~ /^[xX]_./ }

sub string {
	my ($path, $v, $min) = @_;
	return err("$path: not a string") unless is_string($v);
	err("$path: shorter than ", $min // 1) if length($v) < ($min // 1);
	return 1;
}

# A Term: at least two characters, no slash, backslash, space or control.
sub term {
	my ($path, $v) = @_;
	string($path, $v, 2) or return;
	err("$path: \"$v\" is not a term (no /, \\, spaces or control characters)")
		if $v =~ m{[/\\\s[:cntrl:]]};
}

sub version {
	my ($path, $v) = @_;
	string($path, $v) or return;
	err("$path: \"$v\" is not a semantic version (x.y.z)") unless $v =~ /^$semver$/;
}

sub uri {
	my ($path, $v) = @_;
	string($path, $v) or return;
	err("$path: \"$v\" is not a URI") unless $v =~ m{^[A-Za-z][A-Za-z0-9+.-]*:\S+$};
}

sub email {
	my ($path, $v) = @_;
	string($path, $v) or return;
	err("$path: \"$v\" is not an email address") unless $v =~ /^[^@\s]+@[^@\s]+\.[^@\s]+$/;
}

sub object {
	my ($path, $v, $allowed, $required) = @_;
	return err("$path: not an object") unless ref $v eq 'HASH';
	for my $k (sort keys %$v) {
		err("$path: unknown key \"$k\"")
			unless ($allowed && grep { $_ eq $k } @$allowed) || custom($k) || !$allowed;
	}
	for my $k (@{ $required // [] }) {
		err("$path: missing required key \"$k\"") unless exists $v->{$k};
	}
	return 1;
}

my $range = qr/(?:(?:[=!]=|[<>]=?)\s*)?(?:$semver|0)/;

my %check = (
	name => \&term,
	version => \&version,
	abstract => \&string,
	description => \&string,
	generated_by => \&string,
	maintainer => sub {
		my ($path, $v) = @_;
		if (ref $v eq 'ARRAY') {
			err("$path: empty list") unless @$v;
			string("$path\[$_]", $v->[$_]) for 0 .. $#$v;
		}
		else { string($path, $v) }
	},
	license => sub {
		my ($path, $v) = @_;
		if (ref $v eq 'HASH') {
			err("$path: empty object") unless %$v;
			uri("$path.$_", $v->{$_}) for sort keys %$v;
		}
		else {
			my @l = ref $v eq 'ARRAY' ? @$v : ($v);
			err("$path: empty list") unless @l;
			for (@l) {
				err("$path: \"", $_ // 'null', "\" is not a license the spec knows")
					unless is_string($_) && $license{$_};
			}
		}
	},
	provides => sub {
		my ($path, $v) = @_;
		object($path, $v) or return;
		err("$path: no extension") unless %$v;
		for my $ext (sort keys %$v) {
			my $p = "$path.$ext";
			term("$path key", $ext);
			object($p, $v->{$ext}, [qw(file version abstract docfile docpath)],
				[qw(file version)]) or next;
			my $e = $v->{$ext};
			version("$p.version", $e->{version}) if exists $e->{version};
			string("$p.abstract", $e->{abstract}) if exists $e->{abstract};
			for my $f (qw(file docfile)) {
				next unless exists $e->{$f};
				string("$p.$f", $e->{$f}, 2) or next;
				err("$p.$f: $e->{$f} is not a relative Unix path") if $e->{$f} =~ m{^/|\\};
				err("$p.$f: $e->{$f} does not exist") unless -f "$dir/$e->{$f}";
			}
		}
	},
	'meta-spec' => sub {
		my ($path, $v) = @_;
		object($path, $v, [qw(version url)], ['version']) or return;
		err("$path.version: must be 1.0.x") unless is_string($v->{version}) && $v->{version} =~ /^1\.0\.\d+$/;
		err("$path.url: not the spec's URL")
			if exists $v->{url} && !(is_string($v->{url}) && $v->{url} =~ m{^https?://pgxn\.org/meta/spec\.txt$});
	},
	prereqs => sub {
		my ($path, $v) = @_;
		object($path, $v, [qw(configure build test runtime develop)]) or return;
		err("$path: empty object") unless %$v;
		for my $phase (grep { !custom($_) } sort keys %$v) {
			my $pp = "$path.$phase";
			object($pp, $v->{$phase}, [qw(requires recommends suggests conflicts)]) or next;
			err("$pp: empty object") unless %{ $v->{$phase} };
			for my $rel (grep { !custom($_) } sort keys %{ $v->{$phase} }) {
				my $r = $v->{$phase}{$rel};
				object("$pp.$rel", $r) or next;
				err("$pp.$rel: empty object") unless %$r;
				for my $name (sort keys %$r) {
					term("$pp.$rel key", $name);
					my $want = $r->{$name};
					next if defined $want && !ref $want && $want =~ /^0$/;
					err("$pp.$rel.$name: \"", $want // 'null', "\" is not a version range")
						unless is_string($want) && $want =~ /^$range(?:,\s*$range)*$/;
				}
			}
		}
	},
	resources => sub {
		my ($path, $v) = @_;
		object($path, $v, [qw(homepage bugtracker repository)]) or return;
		err("$path: empty object") unless %$v;
		uri("$path.homepage", $v->{homepage}) if exists $v->{homepage};
		if (exists $v->{bugtracker}) {
			my $b = $v->{bugtracker};
			if (object("$path.bugtracker", $b, [qw(web mailto)])) {
				err("$path.bugtracker: needs web or mailto") unless exists $b->{web} || exists $b->{mailto};
				uri("$path.bugtracker.web", $b->{web}) if exists $b->{web};
				email("$path.bugtracker.mailto", $b->{mailto}) if exists $b->{mailto};
			}
		}
		if (exists $v->{repository}) {
			my $r = $v->{repository};
			if (object("$path.repository", $r, [qw(url web type)])) {
				err("$path.repository: needs web, or url and type")
					unless exists $r->{web} || (exists $r->{url} && exists $r->{type});
				uri("$path.repository.$_", $r->{$_}) for grep { exists $r->{$_} } qw(url web);
				err("$path.repository.type: not a lowercase string")
					if exists $r->{type} && !(is_string($r->{type}) && $r->{type} =~ /^[a-z]+$/);
			}
		}
	},
	tags => sub {
		my ($path, $v) = @_;
		return err("$path: not a list") unless ref $v eq 'ARRAY';
		err("$path: empty list") unless @$v;
		for my $i (0 .. $#$v) {
			my $t = $v->[$i];
			string("$path\[$i]", $t, 2) or next;
			err("$path\[$i]: longer than 255 characters") if length($t) > 255;
			err("$path\[$i]: \"$t\" has a slash, backslash or control character")
				if $t =~ m{[/\\[:cntrl:]]};
		}
	},
	no_index => sub {
		my ($path, $v) = @_;
		object($path, $v, [qw(file directory)]) or return;
		for my $k (grep { !custom($_) } sort keys %$v) {
			my @l = ref $v->{$k} eq 'ARRAY' ? @{ $v->{$k} } : ($v->{$k});
			string("$path.$k", $_) for @l;
		}
	},
	release_status => sub {
		my ($path, $v) = @_;
		err("$path: must be stable, testing or unstable")
			unless is_string($v) && $v =~ /^(stable|testing|unstable)$/;
	},
);

for my $k (qw(name version abstract maintainer license provides meta-spec)) {
	err("missing required key \"$k\"") unless exists $meta->{$k};
}
for my $k (sort keys %$meta) {
	if ($check{$k}) { $check{$k}->($k, $meta->{$k}) }
	elsif (!custom($k)) { err("unknown key \"$k\"") }
}

if (@errors) {
	print "$file: $_\n" for @errors;
	exit 1;
}
printf "%s: valid PGXN meta spec %s (%s %s)\n", $file, $meta->{'meta-spec'}{version},
	$meta->{name}, $meta->{version};
